"""Per-token cost over one long streamed answer (issue: per-step work independent of
how long a request has run).

Starts ``mmserve serve`` on the tiny checkpoint (127.0.0.1), streams one chat answer of
``--tokens`` tokens (``ignore_eos``) with ``stream_options.include_usage``, and times the
gap between consecutive server-sent chunks. Reports the mean gap over the first and the
last ``--window`` chunks and their ratio (target <= 1.2 at 6,000 tokens), plus the same
ratio for engine steps measured in this process (``Engine.step`` on the same checkpoint,
no HTTP, in thread CPU time), so the two sides of the boundary can be told apart. The
stream's gaps are wall time: read them on a quiet machine.

    python -m benchmarks.long_stream                 # 6,000 tokens, ~1-2 min on 2 cores
    python -m benchmarks.long_stream --tokens 2000   # quicker
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from benchmarks.servers import mmserve_server
from mmserve.config import EngineConfig
from mmserve.engine.engine import Engine
from mmserve.engine.request import SamplingParams
from mmserve.model.loader import load_model
from mmserve.model.make_checkpoint import ensure_model


def stream_gaps(url: str, tokens: int, timeout: float = 600) -> list[float]:
    """Seconds between consecutive content chunks of one streamed chat answer.

    Raises:
        RuntimeError: a non-200 answer or fewer chunks than ``tokens // 2``.
    """
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    body = {
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Content-Type": "application/json"}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{resp.status}: {resp.read()[:300]!r}")
    times: list[float] = []
    for line in resp:
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content") is not None:
                times.append(time.perf_counter())
    conn.close()
    if len(times) < tokens // 2:
        raise RuntimeError(f"only {len(times)} chunks for {tokens} tokens")
    return [b - a for a, b in zip(times, times[1:], strict=False)]


@torch.inference_mode()
def step_times(model_dir: str, tokens: int) -> list[float]:
    """CPU seconds of this thread per ``Engine.step`` for one request of ``tokens``
    output tokens (thread CPU time, not wall time: on a shared machine other processes
    stretch wall time unevenly over a long run, CPU time counts the step's own work)."""
    loaded = load_model(model_dir)
    eng = Engine(EngineConfig(model_path=model_dir), model=loaded)
    msg = eng.processor.make_request(
        messages=[{"role": "user", "content": "Tell me a very long story."}],
        params=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
    )
    col = eng.track(msg)
    out = []
    while not col.finished:
        t = time.thread_time()
        eng.step()
        out.append(time.thread_time() - t)
    return out[1:]  # the first step is the prefill


def window_ratio(gaps: list[float], window: int) -> dict[str, float]:
    """Mean of the first and last ``window`` gaps (ms) and last / first."""
    first = statistics.fmean(gaps[:window]) * 1e3
    last = statistics.fmean(gaps[-window:]) * 1e3
    return {"first_ms": first, "last_ms": last, "ratio": last / first}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run both measurements and print them; returns the figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--window", type=int, default=300)
    ap.add_argument("--model", type=Path, help="checkpoint (default: the tiny one)")
    ap.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = ap.parse_args(argv)
    model_dir = str(args.model or ensure_model("tiny"))
    with mmserve_server(model_dir, []) as (url, _proc):
        stream_gaps(url, 64)  # warm-up
        http_gaps = stream_gaps(url, args.tokens)
    res = {
        "tokens": args.tokens,
        "window": args.window,
        "http_stream": window_ratio(http_gaps, args.window),
        "engine_steps": window_ratio(step_times(model_dir, args.tokens), args.window),
    }
    for name in ("http_stream", "engine_steps"):
        r = res[name]
        print(
            f"{name:13s} first {args.window}: {r['first_ms']:.3f} ms  last {args.window}: "
            f"{r['last_ms']:.3f} ms  ratio {r['ratio']:.2f} (target <= 1.2)"
        )
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
