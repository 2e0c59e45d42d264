"""``python -m benchmarks engine-process``: ``mmserve serve`` with the engine core in its
own process (the default) against ``--engine-in-process``, over HTTP on the same model:
time to first token of one request on an idle server, and output tokens/s of
``--concurrency`` streamed chats of ``--tokens`` tokens each (``ignore_eos``), in
interleaved rounds (alternating order), medians (``benchmarks/README.md``, "Engine
process")."""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from benchmarks import over_http as http
from benchmarks import report

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
    """Both servers side by side; per round: ``--ttft-probes`` single requests one after
    another (median TTFT), then one burst of ``--concurrency`` streams (output tokens/s).

    Returns:
        0 (exit code); the results go to ``--out`` as ``engine_process.json`` / ``.md``.
    """
    ttft: dict[str, list[float]] = {k: [] for k in SYSTEMS}
    tps: dict[str, list[float]] = {k: [] for k in SYSTEMS}
    cpu: dict[str, list[float]] = {k: [] for k in SYSTEMS}
    with (
        http.mmserve_server(model_dir, SYSTEMS["split"], args.threads) as (split_url, sp),
        http.mmserve_server(model_dir, SYSTEMS["in_process"], args.threads) as (one_url, op),
    ):
        servers = {"split": (split_url, sp.pid), "in_process": (one_url, op.pid)}
        for url, _ in servers.values():  # warm-up
            http.run_load(url, _bodies(4, 4, 10**6), [0.0] * 4)
        for r in range(args.rounds):
            for name in SYSTEMS if r % 2 == 0 else reversed(list(SYSTEMS)):
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
    med = statistics.median
    rows: dict[str, dict[str, Any]] = {
        name: {
            "ttft_ms": 1e3 * med(ttft[name]),
            "tokens_per_s": med(tps[name]),
            "cpu_us_per_token": med(cpu[name]),
        }
        for name in SYSTEMS
    }
    ratio_ttft = [a / b for a, b in zip(ttft["split"], ttft["in_process"], strict=True)]
    ratio_tps = [a / b for a, b in zip(tps["split"], tps["in_process"], strict=True)]
    out = {
        "model": model_dir,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "tokens": args.tokens,
        "rows": rows,
        "ttft_split_over_in_process": med(ratio_ttft),
        "tokens_per_s_split_over_in_process": med(ratio_tps),
        "ttft_ms": ttft,
        "tokens_per_s": tps,
        "loadavg": report.loadavg(),
    }
    md = report.md_table(
        "server | TTFT idle (ms) | tokens/s | server CPU us/token (all processes)",
        [
            [
                n,
                report.fmt(r["ttft_ms"]),
                report.fmt(r["tokens_per_s"]),
                report.fmt(r["cpu_us_per_token"]),
            ]
            for n, r in rows.items()
        ],
    )
    md += (
        f"\nsplit / in-process (median of {args.rounds} interleaved rounds): TTFT "
        f"{out['ttft_split_over_in_process']:.3f}, tokens/s "
        f"{out['tokens_per_s_split_over_in_process']:.3f}; load {out['loadavg']}\n"
    )
    return report.emit(args.out, "engine_process", out, md)


def _tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its children (the engine process)."""
    from pathlib import Path

    total = http.cpu_seconds(pid) or 0.0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
        total += sum(http.cpu_seconds(k) or 0.0 for k in kids)
    return total
