"""Markdown summary, target checks and the pool-sweep plot.

Inputs are the JSON-ready dicts that :mod:`benchmarks.run` writes to
``results/<workload>.json`` and ``results/pool_sweep.json``.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

#: Targets of the issue (thresholds are ratios or fractions).
SPEEDUP_VS_TRANSFORMERS = 6.0
SPEEDUP_VS_CACHE_OFF = 3.0
HIT_OF_OPTIMUM = 0.98
HIT_OF_OPTIMUM_HALF_POOL = 0.90
MAX_TREE_FRACTION = 0.003
MIN_ON_OFF_THROUGHPUT = 0.98


def _system(res: dict, name: str) -> dict | None:
    for s in res.get("systems", []):
        if s["system"] == name:
            return s
    return None


def _fmt(x: Any, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def _target(name: str, value: float | None, op: str, threshold: float, detail: str) -> dict:
    if value is None:
        met = None
    else:
        met = value >= threshold if op == ">=" else value <= threshold
    return {
        "target": name,
        "value": value,
        "op": op,
        "threshold": threshold,
        "met": met,
        "detail": detail,
    }


def check_targets(
    results: dict[str, dict], sweeps: dict[str, dict], main_policy: str
) -> list[dict]:
    """Evaluate the issue's targets on the measured numbers.

    Args:
        results: per-workload result dicts (``run.py`` format), by workload name.
        sweeps: pool-sweep dicts by workload (empty if not run).
        main_policy: the cache-on policy the targets refer to (``lpm``).

    Returns:
        One dict per target: ``target``, ``value``, ``op``, ``threshold``, ``met``
        (True/False, None when not measured) and ``detail``.
    """
    on = f"mmserve-{main_policy}"
    out = []
    mq = results.get("many_questions")
    if mq:
        a, b, c = _system(mq, "transformers"), _system(mq, "mmserve-off"), _system(mq, on)
        for ref, what, need in (
            (a, "transformers", SPEEDUP_VS_TRANSFORMERS),
            (b, "cache-off", SPEEDUP_VS_CACHE_OFF),
        ):
            if c is None or ref is None:
                continue
            for key, unit in (("requests_per_s", "wall"), ("requests_per_cpu_s", "CPU")):
                out.append(
                    _target(
                        f"many_questions: cache-on req/s vs {what} ({unit} time)",
                        c[key] / ref[key],
                        ">=",
                        need,
                        f"{c[key]:.3g} vs {ref[key]:.3g} req/s ({unit} time)",
                    )
                )
    for name in ("many_questions", "video_frames"):
        res = results.get(name)
        c = _system(res, on) if res else None
        if c:
            opt = res["prompts"]["optimal_hit_rate"]
            out.append(
                _target(
                    f"{name}: {main_policy} hit rate / offline optimum",
                    c["cache_hit_rate"] / opt if opt else None,
                    ">=",
                    HIT_OF_OPTIMUM,
                    f"{c['cache_hit_rate']:.4f} vs optimum {opt:.4f}",
                )
            )
    mt = results.get("multi_turn")
    c = _system(mt, f"{on}-halfpool") if mt else None
    if c:
        opt = mt["prompts"]["optimal_hit_rate"]
        others = [
            f"{s['system'].removeprefix('mmserve-').removesuffix('-halfpool')} "
            f"{s['cache_hit_rate'] / opt:.3f}"
            for s in mt["systems"]
            if s["system"].endswith("-halfpool") and s["system"] != c["system"] and opt
        ]
        out.append(
            _target(
                f"multi_turn (pool = half the working set): {main_policy} hit / optimum",
                c["cache_hit_rate"] / opt if opt else None,
                ">=",
                HIT_OF_OPTIMUM_HALF_POOL,
                f"{c['cache_hit_rate']:.4f} vs optimum {opt:.4f}, pool {c['pool_tokens']} of "
                f"working set {mt['prompts']['working_set_tokens']} tokens; arrival "
                f"{mt.get('arrival', 'rounds')}"
                + (f"; other policies' hit/opt: {', '.join(others)}" if others else ""),
            )
        )
    ns = results.get("no_sharing")
    if ns:
        b, c = _system(ns, "mmserve-off"), _system(ns, on)
        if c:
            out.append(
                _target(
                    "no_sharing: radix-tree time / wall time",
                    c["tree_fraction"],
                    "<=",
                    MAX_TREE_FRACTION,
                    f"{c['tree_seconds'] * 1e3:.3g} ms of {c['wall_s']:.3g} s",
                )
            )
        pr = ns.get("paired_on_off")
        for key, unit in (("requests_per_s", "wall"), ("requests_per_cpu_s", "CPU")):
            if not (b and c):
                continue
            if pr:  # median of back-to-back pairs: drift and other processes cancel out
                ratios = sorted(pr["wall_ratios" if unit == "wall" else "cpu_ratios"])
                value = statistics.median(ratios)
                detail = (
                    f"median of {len(ratios)} back-to-back on/off pairs; pair ratios "
                    f"{', '.join(f'{x:.3f}' for x in ratios)}"
                )
            else:
                value = c[key] / b[key]
                detail = f"{c[key]:.4g} vs {b[key]:.4g} req/s (single runs)"
            out.append(
                _target(
                    f"no_sharing: cache-on / cache-off throughput ({unit} time)",
                    value,
                    ">=",
                    MIN_ON_OFF_THROUGHPUT,
                    detail,
                )
            )
    for name, sweep in sweeps.items():
        if not sweep.get("points"):
            continue
        p = min(sweep["points"], key=lambda q: q["pool_tokens"])
        ok = bool(p["all_finished"] and p["output_mismatches"] == 0 and p["leak_free"])
        out.append(
            _target(
                f"{name}, smallest pool: all finish, outputs == uncached, no page leak",
                1.0 if ok else 0.0,
                ">=",
                1.0,
                f"pool {p['pool_tokens']} tokens: finished={p['all_finished']}, "
                f"mismatches={p['output_mismatches']}, leak_free={p['leak_free']}, "
                f"retractions={p.get('retractions', 0)}",
            )
        )
    return out


def workload_table(res: dict) -> str:
    """Markdown table of one workload's systems with ratios vs (a) and (b)."""
    a = _system(res, "transformers")
    b = _system(res, "mmserve-off")
    opt = res["prompts"]["optimal_hit_rate"]
    head = (
        "| system | req/s | req/CPU-s | out tok/s | TTFT p50 (s) | TTFT p99 (s) | hit rate "
        "| optimum | hit/opt | vision runs | tree time % | x (a) | x (b) | x (a) CPU "
        "| x (b) CPU | mismatch vs (b) | agree (a) |\n"
        "|---|" + "---:|" * 16 + "\n"
    )
    rows = []
    for s in res["systems"]:
        cmp = res.get("comparisons", {}).get(s["system"], {})
        ra = s["requests_per_s"] / a["requests_per_s"] if a else None
        rb = s["requests_per_s"] / b["requests_per_s"] if b else None
        ca = s["requests_per_cpu_s"] / a["requests_per_cpu_s"] if a else None
        cb = s["requests_per_cpu_s"] / b["requests_per_cpu_s"] if b else None
        hit = s["cache_hit_rate"]
        agree = cmp.get("agree_with_transformers")
        rows.append(
            "| "
            + " | ".join(
                [
                    s["system"] + (" *" if s["measured_requests"] < s["requests"] else ""),
                    _fmt(s["requests_per_s"]),
                    _fmt(s["requests_per_cpu_s"]),
                    _fmt(s["output_tokens_per_s"]),
                    _fmt(s["ttft_p50_s"]),
                    _fmt(s["ttft_p99_s"]),
                    _fmt(hit, ".4f"),
                    _fmt(opt, ".4f"),
                    _fmt(hit / opt if opt else None, ".3f"),
                    _fmt(s["vision_tower_runs"]),
                    _fmt(100 * s["tree_fraction"], ".3f") if s["kind"] == "mmserve" else "-",
                    _fmt(ra, ".2f"),
                    _fmt(rb, ".2f"),
                    _fmt(ca, ".2f"),
                    _fmt(cb, ".2f"),
                    _fmt(cmp.get("mismatches_vs_off")),
                    agree or "-",
                ]
            )
            + " |"
        )
    return head + "\n".join(rows) + "\n"


def sweep_table(sweep: dict) -> str:
    """Markdown table of the KV-pool sweep."""
    head = (
        "| pool (tokens) | pool / working set | hit rate | hit/opt | req/s | req/CPU-s "
        "| out tok/s | TTFT p50 (s) | retractions | finished | mismatch vs uncached "
        "| leak-free |\n"
        "|" + "---:|" * 12 + "\n"
    )
    opt = sweep["optimal_hit_rate"]
    rows = []
    for p in sweep["points"]:
        rows.append(
            f"| {p['pool_tokens']} | {p['pool_tokens'] / sweep['working_set_tokens']:.3f} "
            f"| {p['cache_hit_rate']:.4f} | {p['cache_hit_rate'] / opt:.3f} "
            f"| {p['requests_per_s']:.3g} | {p['requests_per_cpu_s']:.3g} "
            f"| {p['output_tokens_per_s']:.3g} "
            f"| {p['ttft_p50_s']:.3g} | {p.get('retractions', 0)} | {_fmt(p['all_finished'])} "
            f"| {p['output_mismatches']} | {_fmt(p['leak_free'])} |"
        )
    return head + "\n".join(rows) + "\n"


def write_summary(
    path: Path,
    results: dict[str, dict],
    sweeps: dict[str, dict],
    targets: list[dict],
    meta: dict,
) -> str:
    """Write ``summary.md`` and return its text."""
    lines = [
        "# mmserve benchmark summary",
        "",
        f"- model: `{meta['model']}` ({meta['model_dir']}), torch threads: {meta['threads']}, "
        f"scale: {meta['scale']}, seed: {meta['seed']}",
        f"- total run time: {meta['total_seconds']:.1f} s; load average at start/end: "
        f"{meta['loadavg_start']} / {meta['loadavg_end']} (other processes on the machine "
        "inflate wall times; CPU-time figures (req/CPU-s) are not inflated by them)",
        "- (a) = `transformers` generate (the checkpoint's ForConditionalGeneration class), "
        "one request at a time; "
        "(b) = `mmserve-off` (radix cache and vision-embedding cache disabled); "
        "`mmserve-<policy>` = cache on",
        "- every system: same prompts, greedy, `max_tokens` output tokens (ignore_eos / "
        "min_new_tokens). TTFT counted from the request's submission (includes queueing): "
        "a round's for one-round workloads, each turn's for closed-loop multi_turn; "
        "transformers TTFT measured with a generate() streamer.",
        "- `*` = subsampled system (see notes); `hit/opt` = hit rate / offline optimum "
        "(SGLang Theorem 3.1: 1 - trie tokens / prompt tokens); mismatch = requests whose "
        "greedy tokens differ from (b); agree (a) = requests equal to transformers' tokens.",
        "- vision runs: images encoded by the vision tower; (b) has no embedding cache but "
        "encodes each distinct image once per prefill step, so it can be below the request "
        "count.",
        "",
        "## Targets",
        "",
        "| target | value | threshold | met | detail |",
        "|---|---:|---:|---|---|",
    ]
    for t in targets:
        met = {True: "met", False: "**MISSED**", None: "not measured"}[t["met"]]
        lines.append(
            f"| {t['target']} | {_fmt(t['value'], '.4g')} | {t['op']} {t['threshold']} "
            f"| {met} | {t['detail']} |"
        )
    for name, res in results.items():
        pr = res["prompts"]
        lines += [
            "",
            f"## {name}",
            "",
            res["description"] + ".",
            f"{pr['requests']} requests, {pr['total_tokens']} prompt tokens, "
            f"{pr['distinct_tokens']} distinct (trie) tokens, offline-optimal hit rate "
            f"{pr['optimal_hit_rate']:.4f}, working set {pr['working_set_tokens']} tokens, "
            f"{res['params']['max_tokens']} output tokens per request.",
            "",
            workload_table(res),
        ]
        notes = list(res.get("notes", []))
        for s in res["systems"]:
            notes += [f"{s['system']}: {n}" for n in s.get("notes", [])]
        notes += res.get("skipped", [])
        lines += [f"- {n}" for n in notes]
    for sweep in sweeps.values():
        lines += [
            "",
            f"## KV pool sweep ({sweep['workload']}, policy {sweep['policy']}, "
            f"arrival {sweep.get('arrival', 'rounds')})",
            "",
            f"Working set {sweep['working_set_tokens']} tokens (trie tokens + all outputs); "
            f"one request needs {sweep['one_request_tokens']} tokens; offline optimum "
            f"{sweep['optimal_hit_rate']:.4f}. Plot: `pool_sweep.png`.",
            "",
            sweep_table(sweep),
        ]
    text = "\n".join(lines) + "\n"
    path.write_text(text, encoding="utf-8")
    return text


def plot_sweep(path: Path, sweeps: dict[str, dict]) -> bool:
    """Plot hit rate / optimum and throughput against pool size / working set.

    One line per swept workload. Returns False if matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, (name, sweep) in enumerate(sweeps.items()):
        color = f"C{k}"
        pts = sorted(sweep["points"], key=lambda p: p["pool_tokens"])
        ws = sweep["working_set_tokens"]
        x = [p["pool_tokens"] / ws for p in pts]
        opt = sweep["optimal_hit_rate"]
        ax1.plot(x, [p["cache_hit_rate"] / opt for p in pts], "o-", c=color, label=name)
        ax2.plot(x, [p["requests_per_s"] for p in pts], "o-", c=color, label=f"{name} (wall)")
        cpu = [p["requests_per_cpu_s"] for p in pts]
        ax2.plot(x, cpu, "s--", c=color, alpha=0.5, label=f"{name} (CPU time)")
        ax1.axvline(sweep["one_request_tokens"] / ws, ls=":", c=color)
    ax1.axhline(1.0, ls="--", c="gray")
    ax1.set_xlabel("KV pool / working set (dotted: one request fits)")
    ax1.set_ylabel("hit rate / offline optimum")
    ax1.set_ylim(0, 1.05)
    ax1.legend()
    ax2.set_xlabel("KV pool / working set")
    ax2.set_ylabel("requests / s")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize="small", loc="lower right")
    policy = next(iter(sweeps.values()))["policy"] if sweeps else ""
    fig.suptitle(f"hit rate and throughput vs KV pool size (policy {policy})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
