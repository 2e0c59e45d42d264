"""Open-loop load generator for any OpenAI-compatible chat completions server.

Every request is a streaming ``POST /v1/chat/completions`` whose images are ``data:``
URLs (the same bytes to every server), with ``max_tokens`` = N, ``ignore_eos`` (so every
answer has exactly N tokens), greedy sampling and ``stream_options.include_usage`` (the
token counts are read from the final usage chunk and checked). Arrivals are open-loop:
each request is sent at its scheduled time whatever the server is doing, from a
seeded Poisson process at a given rate, or all at once (a burst, ``rate = inf``).

Per request it records the send time, the time of every chunk that carries content,
and the usage; :func:`summarize` turns a run into the figures SGLang's
``bench_serving`` and ``vllm bench serve`` report: TTFT (send to first content),
TPOT (``(latency - TTFT) / (output tokens - 1)``), inter-token latency (gaps between
content chunks), end-to-end latency (p50/p90/p99 each), request and token
throughput over the run's span (first send to last answer), and goodput (requests per
second that met the stated SLO on TTFT and TPOT).

The HTTP client is httpx's ``AsyncClient`` (one connection per concurrent request);
bodies are serialised before the run starts, so the client's JSON and base64 work
is not inside the timed region.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np

from benchmarks.workloads import Workload


def image_mime(data: bytes) -> str:
    """MIME type of encoded image bytes (PNG, JPEG, GIF or WebP; else octet-stream)."""
    if data.startswith(b"\x89PNG"):
        return "image/png"
    if data.startswith(b"\xff\xd8"):
        return "image/jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return "application/octet-stream"


def data_url(data: bytes) -> str:
    """``data:<mime>;base64,<...>`` for encoded image bytes."""
    return f"data:{image_mime(data)};base64,{base64.b64encode(data).decode()}"


def openai_messages(wl: Workload) -> list[list[dict]]:
    """Each request of ``wl`` (submission order) as OpenAI chat messages.

    An image part ``{"type": "image"}`` becomes ``{"type": "image_url", "image_url":
    {"url": "data:..."}}`` with the next image of the prompt; other parts are kept.
    """
    urls = {name: data_url(b) for name, b in wl.images.items()}
    out = []
    for p in wl.prompts:
        it = iter(p.images)
        msgs = []
        for m in p.messages:
            content = m["content"]
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") == "image":
                        parts.append({"type": "image_url", "image_url": {"url": urls[next(it)]}})
                    else:
                        parts.append(part)
                content = parts
            msgs.append({"role": m["role"], "content": content})
        out.append(msgs)
    return out


def request_bodies(
    wl: Workload, model: str | None, extra: dict[str, Any] | None = None
) -> list[bytes]:
    """Serialised streaming request bodies for every request of ``wl``.

    Args:
        model: the ``model`` field (None: left out; servers then use their one model).
        extra: more fields for every body (e.g. llama.cpp's ``cache_prompt``).
    """
    bodies = []
    for msgs in openai_messages(wl):
        body: dict[str, Any] = {
            "messages": msgs,
            "max_tokens": wl.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if model:
            body["model"] = model
        body.update(extra or {})
        bodies.append(json.dumps(body).encode())
    return bodies


def arrival_times(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send offsets (seconds) of ``n`` requests: 0 for all when ``rate`` is inf (a burst),
    else a Poisson process at ``rate`` requests/s (seeded exponential gaps; first at 0)."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"rate must be > 0 or inf, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return [float(x) for x in np.cumsum(gaps)]


@dataclass
class RequestResult:
    """One request as the client saw it (times in seconds from the run's start).

    Attributes:
        index: position in the workload.
        scheduled: when it was due to be sent.
        sent: when the client sent it.
        ok: HTTP 200, a final usage chunk and no error event.
        error: what went wrong, else "".
        ttft: send to first chunk with content (None if none came).
        latency: send to the end of the stream.
        chunk_times: arrival times of the chunks with content.
        prompt_tokens, completion_tokens, cached_tokens: from the usage chunk (cached:
            ``prompt_tokens_details.cached_tokens``, or llama.cpp's ``timings.cache_n``).
        text: the answer.
        finish_reason: the last choice's finish reason.
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
        """Time per output token after the first (None for one-token answers)."""
        n = self.completion_tokens or 0
        if self.ttft is None or self.latency is None or n < 2:
            return None
        return (self.latency - self.ttft) / (n - 1)


async def _one(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    res: RequestResult,
    t0: float,
    headers: dict[str, str],
) -> None:
    await asyncio.sleep(max(0.0, t0 + res.scheduled - time.perf_counter()))
    sent = time.perf_counter()
    res.sent = sent - t0
    text: list[str] = []
    try:
        async with client.stream("POST", url, content=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"error event: {str(chunk['error'])[:300]}"
                    continue
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    content = delta.get("content")
                    if content:
                        if res.ttft is None:
                            res.ttft = now - sent
                        res.chunk_times.append(now - t0)
                        text.append(content)
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens")
                timings = chunk.get("timings")  # llama.cpp
                if timings and res.cached_tokens is None and "cache_n" in timings:
                    res.cached_tokens = timings["cache_n"]
        res.latency = time.perf_counter() - sent
        res.text = "".join(text)
        if not res.error and res.completion_tokens is None:
            res.error = "no usage chunk (stream_options.include_usage ignored?)"
        res.ok = not res.error
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
        res.latency = time.perf_counter() - sent


async def run_load_async(
    base_url: str,
    bodies: Sequence[bytes],
    arrivals: Sequence[float],
    timeout: float = 600.0,
    headers: dict[str, str] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send ``bodies[i]`` at ``arrivals[i]`` seconds after the start; wait for every answer.

    Returns:
        ``(results in workload order, wall seconds from the start to the last answer)``.
    """
    url = base_url.rstrip("/") + "/v1/chat/completions"
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    results = [RequestResult(i, float(a)) for i, a in enumerate(arrivals)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(
            *(_one(client, url, b, r, t0, hdrs) for b, r in zip(bodies, results, strict=True))
        )
        wall = time.perf_counter() - t0
    return results, wall


def run_load(
    base_url: str,
    bodies: Sequence[bytes],
    arrivals: Sequence[float],
    timeout: float = 600.0,
    headers: dict[str, str] | None = None,
) -> tuple[list[RequestResult], float]:
    """:func:`run_load_async` in a fresh event loop."""
    return asyncio.run(run_load_async(base_url, bodies, arrivals, timeout, headers))


@dataclass
class SLO:
    """A latency objective: a request is "good" when TTFT <= ttft_s and TPOT <= tpot_s."""

    ttft_s: float
    tpot_s: float

    def met(self, r: RequestResult) -> bool:
        """Whether ``r`` finished and met both bounds (TPOT counts as met for 1-token answers)."""
        if not r.ok or r.ttft is None:
            return False
        tpot = r.tpot
        return r.ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


def _pcts(xs: Sequence[float]) -> dict[str, float | None]:
    if not len(xs):
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(xs, dtype=float)
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def summarize(
    results: Sequence[RequestResult], expected_tokens: int, slo: SLO, wall: float | None = None
) -> dict[str, Any]:
    """Figures of one run.

    ``duration`` is the span from the first send to the last answer; throughputs are
    over it. ``token_counts_ok`` is True when every request succeeded and reported
    exactly ``expected_tokens`` completion tokens.
    """
    ok = [r for r in results if r.ok]
    starts = [r.sent for r in results]
    ends = [r.sent + (r.latency or 0.0) for r in results]
    duration = (max(ends) - min(starts)) if results else 0.0
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    itl = []
    for r in ok:
        itl += [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    wrong = [r.index for r in ok if r.completion_tokens != expected_tokens]
    good = sum(slo.met(r) for r in results)
    late = [r.sent - r.scheduled for r in results]
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "wall_s": wall,
        "request_throughput": len(ok) / duration if duration else None,
        "output_throughput": out_tokens / duration if duration else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else None,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "cached_tokens": sum(cached) if cached else None,
        "cache_hit_rate": (sum(cached) / in_tokens) if cached and in_tokens else None,
        "expected_tokens_per_request": expected_tokens,
        "token_counts_ok": not wrong and len(ok) == len(results),
        "wrong_token_counts": wrong[:20],
        "ttft_s": _pcts([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": _pcts([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": _pcts(itl),
        "e2e_s": _pcts([r.latency for r in ok if r.latency is not None]),
        "slo": asdict(slo),
        "good_requests": good,
        "goodput": good / duration if duration else None,
        "client_lateness_max_s": max(late) if late else None,
    }
