"""``python -m benchmarks engine-process``: ``mmserve serve`` with the engine core in its
own process (the default) against ``--engine-in-process``, over HTTP on the same model:
time to first token of one request on an idle server, output tokens/s of
``--concurrency`` streamed chats of ``--tokens`` tokens each (``ignore_eos``), and req/s
of the many_questions workload (several questions about each of a few photos, all sent
at once, caches flushed first; its size from ``--scale``) in interleaved rounds
(alternating order), medians (``benchmarks/README.md``, "Engine process")."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks import over_http as http
from benchmarks import report, workloads

SYSTEMS = {"split": (), "in_process": ("--engine-in-process",)}


def _bodies(n: int, tokens: int, offset: int = 0) -> list[bytes]:
    return [
        json.dumps(
            {
                "messages": [{"role": "user", "content": f"question {offset + i}: tell me more"}],
                "max_tokens": tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        for i in range(n)
    ]


def engine_process(args: argparse.Namespace, model_dir: str) -> int:
    """Both servers side by side (from this checkout and from each ``--repo``: rows
    ``split``, ``in_process``, then ``split (REPO)``, ...); per round, every server in
    turn (the order reversed every other round): ``--ttft-probes`` single requests one
    after another (median TTFT), one burst of ``--concurrency`` streams (output
    tokens/s), then many_questions from cold caches (req/s). Ratios split / in-process
    are per round, then medians.

    Returns:
        0 (exit code); the results go to ``--out`` as ``engine_process.json`` / ``.md``.
    """
    repos = {"": workloads.ROOT}
    repos |= {f" ({r})": Path(r).resolve() for r in getattr(args, "repo", None) or []}
    names = [f"{system}{tag}" for tag in repos for system in SYSTEMS]
    ttft: dict[str, list[float]] = {k: [] for k in names}
    tps: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    mq_rps: dict[str, list[float]] = {k: [] for k in names}
    size = workloads.SCALES["http"][args.scale]
    mq = workloads.many_questions(*size["many_questions"], size["max_tokens"], args.seed)
    mq_bodies = http.request_bodies(mq, None)
    with contextlib.ExitStack() as stack:
        servers = {}
        for tag, repo in repos.items():
            for system, flags in SYSTEMS.items():
                server = http.mmserve_server(model_dir, flags, args.threads, repo=repo)
                url, proc = stack.enter_context(server)
                servers[f"{system}{tag}"] = (url, proc.pid)
        for url, _ in servers.values():  # warm-up (text and photos)
            http.run_load(url, _bodies(4, 4, 10**6), [0.0] * 4)
            http.run_load(url, mq_bodies[:2], [0.0] * 2)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else reversed(names):
                url, pid = servers[name]
                probes = []
                for p in range(args.ttft_probes):  # one request at a time: an idle server
                    res, _ = http.run_load(url, _bodies(1, 1, 1000 * r + p), [0.0])
                    assert res[0].ok and res[0].ttft is not None, res[0].error
                    probes.append(res[0].ttft)
                ttft[name].append(statistics.median(probes))
                bodies = _bodies(args.concurrency, args.tokens, 10**5 * (r + 1))
                cpu0 = _tree_cpu(pid)
                results, _ = http.run_load(url, bodies, [0.0] * len(bodies))
                s = http.summarize(results, args.tokens)
                if not s["token_counts_ok"]:
                    raise RuntimeError(f"{name}: {s['errors']}")
                tps[name].append(s["output_throughput"])
                cpu[name].append(1e6 * (_tree_cpu(pid) - cpu0) / s["output_tokens"])
                mq_rps[name].append(_many_questions(url, mq_bodies, mq.max_tokens))
    med = statistics.median
    rows: dict[str, dict[str, Any]] = {
        name: {
            "ttft_ms": 1e3 * med(ttft[name]),
            "tokens_per_s": med(tps[name]),
            "cpu_us_per_token": med(cpu[name]),
            "many_questions_req_s": med(mq_rps[name]),
        }
        for name in names
    }

    def ratio(xs: dict[str, list[float]], tag: str) -> float:
        pairs = zip(xs[f"split{tag}"], xs[f"in_process{tag}"], strict=True)
        return med(a / b for a, b in pairs)

    ratios = {
        f"split / in-process{tag}": {
            "ttft": ratio(ttft, tag),
            "tokens_per_s": ratio(tps, tag),
            "many_questions_req_s": ratio(mq_rps, tag),
        }
        for tag in repos
    }
    out = {
        "model": model_dir,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "tokens": args.tokens,
        "many_questions": mq.description,
        "rows": rows,
        "ratios": ratios,
        "ttft_split_over_in_process": ratios["split / in-process"]["ttft"],
        "tokens_per_s_split_over_in_process": ratios["split / in-process"]["tokens_per_s"],
        "many_questions_split_over_in_process": ratios["split / in-process"][
            "many_questions_req_s"
        ],
        "ttft_ms": ttft,
        "tokens_per_s": tps,
        "many_questions_req_s": mq_rps,
        "loadavg": report.loadavg(),
    }
    md = report.md_table(
        "server | TTFT idle (ms) | tokens/s | server CPU us/token (all processes) | "
        "many_questions req/s",
        [
            [
                n,
                report.fmt(r["ttft_ms"]),
                report.fmt(r["tokens_per_s"]),
                report.fmt(r["cpu_us_per_token"]),
                report.fmt(r["many_questions_req_s"]),
            ]
            for n, r in rows.items()
        ],
    )
    md += f"\nmedians of {args.rounds} interleaved rounds; many_questions: {mq.description}\n"
    for label, q in ratios.items():
        md += (
            f"{label}: TTFT {q['ttft']:.3f}, tokens/s {q['tokens_per_s']:.3f}, "
            f"many_questions req/s {q['many_questions_req_s']:.3f}\n"
        )
    md += f"load {out['loadavg']}\n"
    return report.emit(args.out, "engine_process", out, md)


def _many_questions(url: str, bodies: list[bytes], tokens: int) -> float:
    """req/s of ``bodies`` (many_questions) sent at once to ``url`` after its prefix and
    vision caches are emptied (each round from the same cold start)."""
    http.flush(url)
    results, _ = http.run_load(url, bodies, [0.0] * len(bodies))
    s = http.summarize(results, tokens)
    if not s["token_counts_ok"]:
        raise RuntimeError(f"many_questions: {s['errors']}")
    return float(s["request_throughput"])


def _tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its children (the engine process)."""
    total = http.cpu_seconds(pid) or 0.0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
        total += sum(http.cpu_seconds(k) or 0.0 for k in kids)
    return total
