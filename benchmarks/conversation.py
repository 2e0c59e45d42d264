"""``conversation``: a three-turn Responses conversation with a photo in turn 1, continued
with ``previous_response_id``, against resending the whole history with the cache cold.

Each round runs both ways on a fresh photo (distinct per round, so nothing of an
earlier round is cached): the stored chain (turn 1, then turns 2 and 3 by
``previous_response_id``, streamed, TTFT = time to the first ``output_text.delta``),
and the same turns 2 and 3 sent as their whole history (``store: false``) right after a
cache flush (prefix and vision caches cold). Rounds alternate which way goes first;
the table gives medians, the ratio and the chain's ``cached_tokens``.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time

import httpx

from benchmarks import report
from benchmarks.over_http import flush, mmserve_server
from benchmarks.workloads import photos

OPTIONS: list[tuple[tuple[str, ...], dict]] = [
    (("--rounds",), dict(type=int, default=5, help="interleaved rounds (median)")),
    (("--max-tokens",), dict(type=int, default=8, help="answer length of each turn")),
]
QUESTIONS = ("What is in this photo?", "What colour is it?", "Why is it there?")


def _stream(url: str, body: dict) -> tuple[float, dict]:
    """Stream one response: seconds to the first text delta, and the final response."""
    t0 = time.perf_counter()
    ttft, final = None, None
    body = {**body, "stream": True}
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if ev["type"] == "response.output_text.delta" and ttft is None:
                ttft = time.perf_counter() - t0
            if ev["type"] in ("response.completed", "response.incomplete"):
                final = ev["response"]
    assert final is not None, "no final event"
    return ttft if ttft is not None else time.perf_counter() - t0, final


def _turn1(photo: bytes) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(photo).decode()
    content = [
        {"type": "input_image", "image_url": url},
        {"type": "input_text", "text": QUESTIONS[0]},
    ]
    return [{"role": "user", "content": content}]


def _chain(url: str, photo: bytes, kw: dict) -> tuple[list[dict], list[str]]:
    """The stored chain: the three final responses (turn 1 untimed) and their texts."""
    first = _stream(url, {**kw, "input": _turn1(photo)})[1]
    out, prev = [], first
    texts = [first["output"][0]["content"][0]["text"]]
    for q in QUESTIONS[1:]:
        ttft, resp = _stream(url, {**kw, "input": q, "previous_response_id": prev["id"]})
        out.append({"ttft": ttft, "usage": resp["usage"]})
        texts.append(resp["output"][0]["content"][0]["text"])
        prev = resp
    return out, texts


def _resend(url: str, photo: bytes, texts: list[str], kw: dict) -> list[float]:
    """Turns 2 and 3 as their whole history, each after a cache flush: TTFTs."""
    history = _turn1(photo)
    out = []
    for i, q in enumerate(QUESTIONS[1:]):
        history = [*history, {"role": "assistant", "content": texts[i]}]
        history = [*history, {"role": "user", "content": q}]
        flush(url)
        out.append(_stream(url, {**kw, "input": history, "store": False})[0])
    return out


def conversation(args: argparse.Namespace, model_dir: str) -> int:
    """``conversation``: TTFT of turns 2 and 3 by ``previous_response_id`` against the
    whole history resent with the cache cold (medians of interleaved rounds)."""
    pics = list(photos(args.rounds + 1).values())
    kw = {"max_output_tokens": args.max_tokens, "temperature": 0}
    chained: list[list[dict]] = []
    resent: list[list[float]] = []
    with mmserve_server(model_dir, threads=args.threads) as (url, _):
        _chain(url, pics[-1], kw)  # warm-up (imports, kernels)
        for r in range(args.rounds):
            flush(url)
            photo = pics[r]
            if r % 2 == 0:
                c, texts = _chain(url, photo, kw)
                cold = _resend(url, photo, texts, kw)
            else:  # resend first: it needs the texts, so the chain's turn 1 runs untimed
                texts = _chain(url, photo, kw)[1]
                cold = _resend(url, photo, texts, kw)
                flush(url)
                c, _t = _chain(url, photo, kw)
            chained.append(c)
            resent.append(cold)
    rows, out_turns = [], []
    for t in (0, 1):
        warm = statistics.median(c[t]["ttft"] for c in chained)
        cold = statistics.median(x[t] for x in resent)
        cached = statistics.median(
            c[t]["usage"]["input_tokens_details"]["cached_tokens"] for c in chained
        )
        tokens = statistics.median(c[t]["usage"]["input_tokens"] for c in chained)
        out_turns.append(
            {"turn": t + 2, "ttft_chain_s": warm, "ttft_resend_cold_s": cold,
             "ratio_chain_over_resend": warm / cold, "input_tokens": tokens,
             "cached_tokens": cached}
        )  # fmt: skip
        rows.append([t + 2, tokens, cached, f"{warm:.3f}", f"{cold:.3f}", f"{warm / cold:.3f}"])
    raw = {"chain": chained, "resend": resent}
    out = {"model": model_dir, "rounds": args.rounds, "turns": out_turns, "raw": raw,
           "load_average": report.loadavg()}  # fmt: skip
    md = (
        f"checkpoint {model_dir}, {args.rounds} interleaved rounds (medians), "
        f"load average {out['load_average']}\n\n"
        + report.md_table(
            [
                "turn",
                "input tokens",
                "cached tokens (chain)",
                "TTFT chain s",
                "TTFT resend, cold s",
                "ratio",
            ],
            rows,
        )  # fmt: skip
    )
    return report.emit(args.out, "conversation", out, md)
