"""The HTTP runner: a load generator for OpenAI-compatible servers (open or closed loop;
what it sends and reports, and why not ``guidellm``: ``benchmarks/README.md``), batch jobs,
and server processes."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import numpy as np

from benchmarks.report import percentiles
from benchmarks.workloads import ROOT, Workload, data_url, openai_messages

#: ``mmserve serve`` flags of the two mmserve systems.
MMSERVE_SYSTEMS: dict[str, list[str]] = {
    "mmserve": [],
    "mmserve-off": ["--disable-radix-cache", "--vision-cache-bytes", "0"],
}
TERMINAL = ("completed", "failed", "cancelled", "expired")


def arrival_times(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send offsets (s) of ``n`` requests: all 0 for ``rate`` inf, else a Poisson process at
    ``rate`` req/s (seeded exponential gaps, the first at 0).

    Raises:
        ValueError: ``rate`` <= 0.
    """
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"rate must be > 0 or inf, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return [float(x) for x in np.cumsum(gaps)]


def request_bodies(
    wl: Workload, model: str | None, extra: dict | None = None, urls: dict | None = None
) -> list[bytes]:
    """Serialised streaming chat bodies of every request of ``wl``; ``model`` None is left
    out, ``extra`` joins every body, ``urls`` are the images' URLs by name (default: data
    URLs of the bytes)."""
    urls = urls or {n: data_url(b) for n, b in wl.images.items()}
    base = {"max_tokens": wl.max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
    base.update(stream_options={"include_usage": True}, **({"model": model} if model else {}))
    return [
        json.dumps({"messages": openai_messages(p, urls), **base, **(extra or {})}).encode()
        for p in wl.prompts
    ]


@dataclass
class RequestResult:
    """One request as the client saw it (seconds from the run's start).

    ``ok``: HTTP 200, a usage chunk and no error event; ``ttft``: send to the first chunk
    with content; ``latency``: send to the end of the stream; ``chunk_times``: arrivals of
    content chunks; token counts from the usage chunk (cached: ``prompt_tokens_details``,
    or llama.cpp's ``timings.cache_n``).
    """

    index: int
    scheduled: float
    sent: float = 0.0
    ok: bool = False
    error: str = ""
    ttft: float | None = None
    latency: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""
    finish_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first (None below two tokens)."""
        n = self.completion_tokens or 0
        if self.ttft is None or self.latency is None or n < 2:
            return None
        return (self.latency - self.ttft) / (n - 1)


async def send(
    client: httpx.AsyncClient, url: str, body: bytes, res: RequestResult, t0: float
) -> None:
    """Send ``body`` to ``url`` at ``t0 + res.scheduled`` and fill ``res`` from the stream."""
    await asyncio.sleep(max(0.0, t0 + res.scheduled - time.perf_counter()))
    sent = time.perf_counter()
    res.sent, text = sent - t0, []
    try:
        headers = {"Content-Type": "application/json"}
        async with client.stream("POST", url, content=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return
            async for line in resp.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else None
                if data == "[DONE]":
                    break
                if not data:
                    continue
                now, chunk = time.perf_counter(), json.loads(data)
                if "error" in chunk:
                    res.error = f"error event: {str(chunk['error'])[:300]}"
                for choice in chunk.get("choices") or []:
                    if content := (choice.get("delta") or {}).get("content"):
                        res.ttft = now - sent if res.ttft is None else res.ttft
                        res.chunk_times.append(now - t0)
                        text.append(content)
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
                if usage := chunk.get("usage"):
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens")
                timings = chunk.get("timings") or {}  # llama.cpp
                if res.cached_tokens is None and "cache_n" in timings:
                    res.cached_tokens = timings["cache_n"]
        res.latency, res.text = time.perf_counter() - sent, "".join(text)
        if not res.error and res.completion_tokens is None:
            res.error = "no usage chunk (stream_options.include_usage ignored?)"
        res.ok = not res.error
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error, res.latency = f"{type(e).__name__}: {e}"[:300], time.perf_counter() - sent


def run_load(
    base_url: str,
    bodies: Sequence[bytes],
    arrivals: Sequence[float] = (),
    sessions: list[list[int]] | None = None,
    clients: int = 1,
    timeout: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """Send ``bodies`` to the chat endpoint and wait for every answer. Open loop:
    ``bodies[i]`` at ``arrivals[i]`` s after the start. Closed loop (``sessions``: chains of
    body indices): ``clients`` clients take requests from one queue holding each chain's
    first; when one is answered its chain's next joins the end of the queue.

    Returns:
        ``(results in body order, wall seconds from the start to the last answer)``.
    """
    url = base_url.rstrip("/") + "/v1/chat/completions"
    nxt = {a: b for s in sessions or [] for a, b in zip(s, s[1:], strict=False)}

    async def go() -> tuple[list[RequestResult], float]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as http:
            t0 = time.perf_counter()
            if sessions is None:
                results = {i: RequestResult(i, float(a)) for i, a in enumerate(arrivals)}
                await asyncio.gather(
                    *(send(http, url, bodies[i], r, t0) for i, r in results.items())
                )
            else:
                queue: asyncio.Queue[int] = asyncio.Queue()
                for s in sessions:
                    queue.put_nowait(s[0])
                results = {}

                async def client() -> None:
                    while len(results) < len(bodies):
                        try:
                            i = await asyncio.wait_for(queue.get(), 0.05)
                        except asyncio.TimeoutError:
                            continue  # another client's answer may still queue a next turn
                        results[i] = RequestResult(i, time.perf_counter() - t0)
                        await send(http, url, bodies[i], results[i], t0)
                        if i in nxt:
                            queue.put_nowait(nxt[i])

                await asyncio.gather(*(client() for _ in range(clients)))
            return [results[i] for i in sorted(results)], time.perf_counter() - t0

    return asyncio.run(go())


def summarize(
    results: Sequence[RequestResult],
    expected_tokens: int,
    slo: tuple[float, float] = (math.inf, math.inf),
    wall: float | None = None,
) -> dict[str, Any]:
    """Figures of one run. Throughputs are over the span from the first send to the last
    answer; goodput counts requests within ``slo`` = (TTFT s, TPOT s); ``token_counts_ok``:
    every request succeeded with exactly ``expected_tokens`` completion tokens."""
    ok = [r for r in results if r.ok]
    span = max((r.sent + (r.latency or 0.0) for r in results), default=0.0) - min(
        (r.sent for r in results), default=0.0
    )
    per = lambda x: x / span if span else None  # noqa: E731
    out_tok = sum(r.completion_tokens or 0 for r in ok)
    in_tok = sum(r.prompt_tokens or 0 for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    wrong = [r.index for r in ok if r.completion_tokens != expected_tokens]
    good = sum(
        r.ttft is not None and r.ttft <= slo[0] and (r.tpot is None or r.tpot <= slo[1]) for r in ok
    )
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": span,
        "wall_s": wall,
        "request_throughput": per(len(ok)),
        "output_throughput": per(out_tok),
        "total_token_throughput": per(in_tok + out_tok),
        "prompt_tokens": in_tok,
        "output_tokens": out_tok,
        "cached_tokens": sum(cached) if cached else None,
        "cache_hit_rate": sum(cached) / in_tok if cached and in_tok else None,
        "token_counts_ok": not wrong and len(ok) == len(results),
        "wrong_token_counts": wrong[:20],
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": percentiles([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles([r.latency for r in ok if r.latency is not None]),
        "slo": {"ttft_s": slo[0], "tpot_s": slo[1]},
        "good_requests": good,
        "goodput": per(good),
        "client_lateness_max_s": max((r.sent - r.scheduled for r in results), default=None),
    }


def create_batch(url: str, wl: Workload) -> str:
    """Upload ``wl``'s requests (non-streaming) as a JSONL batch input and create a
    chat-completions batch; its id."""
    lines = []
    for i, b in enumerate(json.loads(b) for b in request_bodies(wl, None)):
        del b["stream"], b["stream_options"]
        lines.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions"})
        lines[-1]["body"] = b
    data = "\n".join(json.dumps(x) for x in lines).encode()
    files = {"file": ("in.jsonl", data)}
    r = httpx.post(f"{url}/v1/files", data={"purpose": "batch"}, files=files, timeout=300)
    body = {"input_file_id": r.raise_for_status().json()["id"], "completion_window": "24h"}
    return post_json(f"{url}/v1/batches", {**body, "endpoint": "/v1/chat/completions"})["id"]


def wait_batch(url: str, batch_id: str, timeout: float = 900) -> dict:
    """Poll the batch every 50 ms until it ends; the final batch object.

    Raises:
        TimeoutError: after ``timeout`` seconds; RuntimeError: it did not complete.
    """
    deadline = time.perf_counter() + timeout
    while (b := get_json(f"{url}/v1/batches/{batch_id}"))["status"] not in TERMINAL:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"batch {batch_id} still {b['status']} after {timeout} s")
        time.sleep(0.05)
    if b["status"] != "completed" or b["request_counts"]["failed"]:
        raise RuntimeError(f"batch {batch_id}: {b}")
    return b


# ---- server processes ------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 60) -> Any:
    """GET ``url``, parsed."""
    return httpx.get(url, timeout=timeout).json()


def post_json(url: str, body: Any, timeout: float = 300) -> Any:
    """POST ``body`` as JSON and parse the answer.

    Raises:
        RuntimeError: a status other than 200.
    """
    r = httpx.post(url, json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"{url}: {r.status_code} {r.content[:300]!r}")
    return r.json()


def served_model(url: str) -> str | None:
    """The first id of ``GET /v1/models``, None if the server does not say."""
    try:
        return (get_json(f"{url}/v1/models", 10).get("data") or [{}])[0].get("id")
    except (httpx.HTTPError, ValueError):
        return None


def flush(url: str) -> None:
    """Empty mmserve's prefix and vision caches (retried while requests finish, 10 s).

    Raises:
        RuntimeError: still refused after 10 s.
    """
    for _ in range(40):
        if (r := httpx.post(f"{url}/v1/cache/flush", timeout=300)).status_code == 200:
            return
        time.sleep(0.25)
    raise RuntimeError(f"cache flush refused: {r.status_code} {r.content[:200]!r}")


def cpu_seconds(pid: int | None) -> float | None:
    """CPU seconds of process ``pid``, all its threads; None off Linux or when it is gone.

    Sums the nanosecond run time in ``/proc/PID/task/*/schedstat``: ``/proc/PID/stat``
    counts in clock ticks (10 ms), which rounds a short run's few milliseconds to 0.
    Threads that exited are not in that sum, so a thread pool that shrinks mid-run
    under-counts; ``/proc/PID/stat`` (user + system ticks) is the fallback where
    schedstat is missing (kernels without CONFIG_SCHEDSTATS).
    """
    if pid is None:
        return None
    if Path(f"/proc/{pid}/schedstat").exists():
        total, seen = 0, False
        for task in Path(f"/proc/{pid}/task").glob("*/schedstat"):
            try:
                total += int(task.read_text().split()[0])
                seen = True
            except (OSError, IndexError, ValueError):
                continue  # the thread exited between glob and read
        return total / 1e9 if seen else None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def server(
    cmd: list[str],
    env: dict[str, str],
    log_path: Path | None = None,
    timeout: float = 180,
    cwd: Path = ROOT,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run ``cmd`` plus ``--port`` on a free port; yield ``(url, process)`` once ``/health``
    answers 200; SIGTERM (SIGKILL after 20 s) on exit.

    Raises:
        RuntimeError: the process exited or was not healthy in ``timeout`` s (with its log).
    """
    log: IO[bytes] = open(log_path, "w+b") if log_path else tempfile.TemporaryFile()
    env = {**os.environ, **env}
    deadline = time.time() + timeout
    for attempt in range(3):  # another process may take the free port before the server binds it
        port = free_port()
        log.seek(0)
        log.truncate()
        proc = subprocess.Popen(
            [*cmd, "--port", str(port)], env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT
        )
        url = f"http://127.0.0.1:{port}"
        healthy = False
        while not healthy and proc.poll() is None and time.time() < deadline:
            try:
                healthy = httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.25)
        if healthy:
            break
        log.flush()
        log.seek(0)
        tail = log.read().decode(errors="replace")[-2000:]
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if "address already in use" not in tail.lower() or attempt == 2:
            log.close()
            raise RuntimeError(f"server {cmd[:4]} not healthy (exit {proc.poll()}): {tail}")
    try:
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def mmserve_server(
    model: str | None,
    flags: Sequence[str] = (),
    threads: int = 1,
    log_path: Path | None = None,
    launcher: Sequence[str] = ("-m", "api.cli"),
    env: dict | None = None,
    repo: Path = ROOT,
) -> Any:
    """:func:`server` of ``mmserve serve`` (from checkout ``repo``) on ``model`` (None: the
    bundled one) with ``threads`` OpenMP threads."""
    cmd = [sys.executable, *launcher, "serve", "--host", "127.0.0.1", "--log-level", "warning"]
    cmd += [*(["--model", str(model)] if model else []), "--max-queued-requests", "4096"]
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **(env or {})}
    if repo != ROOT:
        env["PYTHONPATH"] = str(repo)
    return server([*cmd, *flags], env, log_path, timeout=300, cwd=repo)
