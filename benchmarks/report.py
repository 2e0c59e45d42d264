"""The one report: percentiles, one Markdown table writer driven by column specs, targets,
the two suites' summaries and the JSON files (nothing here measures anything)."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: Targets of the in-process suite (ratios or fractions).
SPEEDUP_VS_TRANSFORMERS, SPEEDUP_VS_CACHE_OFF = 6.0, 3.0
HIT_OF_OPTIMUM, HIT_OF_OPTIMUM_HALF_POOL = 0.98, 0.90
MAX_TREE_FRACTION, MIN_ON_OFF_THROUGHPUT = 0.003, 0.98
#: Column specs (:func:`table`) of the summaries' tables.
WORKLOAD_COLS = (
    "system|req/s=requests_per_s|req/CPU-s=requests_per_cpu_s"
    "|out tok/s=output_tokens_per_s|TTFT p50 (s)=ttft_p50_s|TTFT p99 (s)=ttft_p99_s"
    "|hit=cache_hit_rate:.4f|hit/opt=hit_opt:.3f|vision runs=vision_tower_runs"
    "|tree time %=tree_pct:.3f|x (a)=xa:.2f|x (b)=xb:.2f|x (a) CPU=xa_cpu:.2f"
    "|x (b) CPU=xb_cpu:.2f|mismatch vs (b)=mismatches_vs_off"
    "|agree (a)=agree_with_transformers"
)
SWEEP_COLS = (
    "pool (tokens)|pool / working set=of_ws:.3f|hit rate=cache_hit_rate:.4f"
    "|hit/opt=hit_opt:.3f|req/s=requests_per_s|req/CPU-s=requests_per_cpu_s"
    "|TTFT p50 (s)=ttft_p50_s|retractions=retractions|finished=all_finished"
    "|mismatch vs uncached=output_mismatches|leak-free=leak_free"
)
AGREE_COLS = "chat|prompt tokens (mmserve, llama.cpp)=prompt_tokens|equal=agree|reason=reason"
BOUND_COLS = (
    "workload|distinct / total tokens=tokens|distinct / all images=imgs"
    "|prefill ms/tok=prefill_ms:.3f|tower ms/img=tower_s_per_image:ms"
    "|decode ms/step (batch)=decode|bound s (CPU s)=bound"
    "|max speedup from reuse=max_speedup_from_reuse"
)
RUN_COLS = (
    "server, rate|req/s=request_throughput|out tok/s=output_throughput"
    "|TTFT p50=ttft_s.p50:ms|TTFT p99=ttft_s.p99:ms|TPOT p50=tpot_s.p50:ms"
    "|TPOT p99=tpot_s.p99:ms|ITL p99=itl_s.p99:ms|goodput=goodput"
    "|hit=cache_hit_rate:.2f|CPU s=server_cpu_s|tok ok=token_counts_ok"
)


def percentiles(xs: Sequence[float]) -> dict[str, float | None]:
    """``mean``, ``p50``, ``p90``, ``p99`` of ``xs`` (numpy's linear interpolation); all None
    for no values."""
    if not len(xs):
        return dict.fromkeys(("mean", "p50", "p90", "p99"))
    p50, p90, p99 = np.percentile(np.asarray(xs, dtype=float), (50, 90, 99)).tolist()
    return {"mean": float(np.mean(xs)), "p50": p50, "p90": p90, "p99": p99}


def fmt(x: Any, spec: str = ".3g") -> str:
    """``x`` for a table: "-" for None, yes/NO for booleans, ``spec`` for floats ("ms":
    seconds as whole milliseconds)."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float | int) and spec == "ms":
        return f"{x * 1000:.0f}"
    if isinstance(x, float):
        return "inf" if math.isinf(x) else format(x, spec)
    return str(x)


def md_table(head: str | Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; ``head`` is a sequence or "|"-separated; cells go through :func:`fmt`."""
    head = head.split("|") if isinstance(head, str) else head
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]) + "\n"


def table(rows: dict[str, dict], cols: str) -> str:
    """Markdown table of ``rows`` (row name -> figures), the name first; ``cols`` is
    "|"-separated: the name column's header, then ``header=key:format`` per column
    (``key`` a dotted path into the figures; format as :func:`fmt`, default ``.3g``)."""
    spec = []
    for c in cols.split("|")[1:]:
        head, _, key = c.partition("=")
        key, _, f = key.partition(":")
        spec.append((head, key.split("."), f or ".3g"))
    out = []
    for name, d in rows.items():
        row = [name]
        for _, path, f in spec:
            v = d
            for p in path:
                v = v.get(p) if isinstance(v, dict) else None
            row.append(fmt(v, f))
        out.append(row)
    return md_table([cols.split("|")[0]] + [h for h, _, _ in spec], out)


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON; NaN becomes null and infinity "inf"."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None if math.isnan(x) else "inf"
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        return [clean(v) for v in x] if isinstance(x, list | tuple) else x

    Path(path).write_text(json.dumps(clean(obj), indent=2, default=str) + "\n", encoding="utf-8")


def emit(out: Path, name: str, obj: Any, md: str) -> int:
    """Write ``<name>.json`` and ``<name>.md`` in ``out``, print ``md``; returns 0 (exit code)."""
    write_json(out / f"{name}.json", obj)
    (out / f"{name}.md").write_text(md + "\n", encoding="utf-8")
    print(md)
    return 0


def loadavg() -> str:
    """The 1/5/15-minute load averages, or "n/a"."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def target(name: str, value: float | None, op: str, threshold: float, detail: str = "") -> dict:
    """A target's record; ``met`` is None when ``value`` was not measured."""
    met = None if value is None else (value >= threshold if op == ">=" else value <= threshold)
    return dict(target=name, value=value, op=op, threshold=threshold, met=met, detail=detail)


def targets_table(targets: list[dict]) -> str:
    """The targets as a Markdown table."""
    met = {True: "met", False: "**MISSED**", None: "not measured"}
    rows = [
        (t["target"], fmt(t["value"], ".4g"), f"{t['op']} {t['threshold']}", met[t["met"]])
        + (t["detail"],)
        for t in targets
    ]
    return md_table("target|value|threshold|met|detail", rows)


# ---- in-process suite ---------------------------------------------------------------------


def _system(res: dict | None, name: str) -> dict | None:
    return next((s for s in (res or {}).get("systems", []) if s["system"] == name), None)


def engine_targets(results: dict[str, dict], sweeps: dict[str, dict], policy: str) -> list[dict]:
    """The in-process suite's targets on per-workload ``results`` and pool ``sweeps``, for the
    cache-on ``policy``."""
    on, out = f"mmserve-{policy}", []
    mq = results.get("many_questions")
    c = _system(mq, on)
    refs = (("transformers", SPEEDUP_VS_TRANSFORMERS), ("mmserve-off", SPEEDUP_VS_CACHE_OFF))
    for ref, need in refs:
        r = _system(mq, ref)
        for key, unit in (("requests_per_s", "wall"), ("requests_per_cpu_s", "CPU")):
            if c and r:
                name = f"many_questions: cache-on req/s vs {ref} ({unit} time)"
                detail = f"{c[key]:.3g} vs {r[key]:.3g} req/s"
                out.append(target(name, c[key] / r[key], ">=", need, detail))
    hits = (("many_questions", on, HIT_OF_OPTIMUM), ("video_frames", on, HIT_OF_OPTIMUM))
    for name, label, need in (*hits, ("multi_turn", f"{on}-halfpool", HIT_OF_OPTIMUM_HALF_POOL)):
        if c := _system(res := results.get(name), label):
            opt = res["prompts"]["optimal_hit_rate"]
            detail = f"{c['cache_hit_rate']:.4f} vs optimum {opt:.4f}, pool {c['pool_tokens']}"
            value = c["cache_hit_rate"] / opt if opt else None
            out.append(
                target(f"{name} ({label}): hit rate / offline optimum", value, ">=", need, detail)
            )
    ns = results.get("no_sharing")
    b, c = _system(ns, "mmserve-off"), _system(ns, on)
    if b and c:
        name, ms_ = "no_sharing: radix-tree time / wall time", f"{c['tree_seconds'] * 1e3:.3g} ms"
        out.append(target(name, c["tree_fraction"], "<=", MAX_TREE_FRACTION, ms_))
        pairs = ns.get("paired_on_off")
        for key, unit in (("requests_per_s", "wall"), ("requests_per_cpu_s", "cpu")):
            if pairs:  # median of back-to-back pairs: drift and other load cancel out
                value, detail = statistics.median(pairs[f"{unit}_ratios"]), "median of pairs"
            else:
                value, detail = c[key] / b[key], "single runs"
            name = f"no_sharing: cache-on / cache-off throughput ({unit} time)"
            out.append(target(name, value, ">=", MIN_ON_OFF_THROUGHPUT, detail))
    for wl, sweep in sweeps.items():
        p = min(sweep["points"], key=lambda q: q["pool_tokens"])
        ok = p["all_finished"] and p["output_mismatches"] == 0 and bool(p["leak_free"])
        name = f"{wl}, smallest pool: all finish, outputs == uncached, no leak"
        detail = f"pool {p['pool_tokens']}, retractions {p['retractions']}"
        out.append(target(name, float(ok), ">=", 1.0, detail))
    return out


def engine_summary(results: dict, sweeps: dict, targets: list[dict], m: dict) -> str:
    """``summary.md`` of the in-process suite: targets, one table per workload, the sweeps."""
    lines = [
        "# mmserve benchmark summary (in-process)",
        "",
        f"- model `{m['model']}`, torch threads {m['threads']}, scale {m['scale']}, seed "
        f"{m['seed']}; {m['total_seconds']:.1f} s; load average {m['loadavg_start']} -> "
        f"{m['loadavg_end']} (other load inflates wall times, not the CPU-time figures)",
        "- (a) = transformers, (b) = `mmserve-off`, `*` = subsampled (benchmarks/README.md)",
        "",
        "## Targets",
        "",
        targets_table(targets),
    ]
    for name, res in results.items():
        pr, rows = res["prompts"], {}
        a, b = _system(res, "transformers"), _system(res, "mmserve-off")
        for s in res["systems"]:
            r = rows[s["system"] + (" *" if s["measured_requests"] < s["requests"] else "")] = {
                **s,
                **res["comparisons"].get(s["system"], {}),
                "hit_opt": s["cache_hit_rate"] / opt if (opt := pr["optimal_hit_rate"]) else None,
                "tree_pct": 100 * s["tree_fraction"] if s["kind"] == "mmserve" else None,
            }
            for key, unit in (("requests_per_s", ""), ("requests_per_cpu_s", "_cpu")):
                r.update(
                    {f"x{x}{unit}": ref and s[key] / ref[key] for x, ref in (("a", a), ("b", b))}
                )
        lines += [
            f"## {name}",
            "",
            f"{res['description']}. {pr['requests']} requests, {pr['total_tokens']} prompt "
            f"tokens, {pr['distinct_tokens']} distinct, optimum {pr['optimal_hit_rate']:.4f}, "
            f"working set {pr['working_set_tokens']} tokens.",
            "",
            table(rows, WORKLOAD_COLS),
        ]
        notes = res["notes"] + res["skipped"]
        notes += [f"{s['system']}: {n}" for s in res["systems"] for n in s["notes"]]
        lines += [f"- {n}" for n in notes] + [""]
    for sw in sweeps.values():
        pts = {str(p["pool_tokens"]): p for p in sw["points"]}
        for p in pts.values():
            p["of_ws"] = p["pool_tokens"] / sw["working_set_tokens"]
            p["hit_opt"] = p["cache_hit_rate"] / opt if (opt := sw["optimal_hit_rate"]) else None
        lines += [
            f"## KV pool sweep ({sw['workload']}, policy {sw['policy']})",
            "",
            f"Working set {sw['working_set_tokens']} tokens, one request "
            f"{sw['one_request_tokens']}.",
            "",
            table(pts, SWEEP_COLS),
        ]
    return "\n".join(lines) + "\n"


# ---- HTTP suite --------------------------------------------------------------------------


def achieved(res: dict, wl: str, server: str) -> dict[str, Any]:
    """``bound / the server's time`` on the burst run (else the highest rate's), in wall and
    in server CPU seconds."""
    w = res["workloads"][wl]
    bound, runs = w.get("bound") or {}, w["runs"].get(server) or {}
    key = "burst" if "burst" in runs else max(runs, key=float, default=None)
    if not bound or key is None:
        return {"wall": None, "cpu": None, "rate": key}
    r = runs[key]
    cpu = bound["bound_cpu_s"] / r["server_cpu_s"] if r.get("server_cpu_s") else None
    wall = bound["bound_s"] / r["duration_s"] if r.get("duration_s") else None
    return {"wall": wall, "cpu": cpu, "rate": key}


def http_targets(res: dict, workload: str, fraction: float, min_agree: int) -> list[dict]:
    """mmserve reaches ``fraction`` of ``workload``'s bound; llama.cpp agreement."""
    out = []
    if "mmserve" in res["workloads"].get(workload, {}).get("runs", {}):
        a = achieved(res, workload, "mmserve")
        for u in ("wall", "cpu"):
            name = f"{workload}: mmserve achieved / bound ({u} time, {a['rate']} run)"
            out.append(target(name, a[u], ">=", fraction))
    if ag := res.get("agreement"):
        name, detail = "llama.cpp agreement: equal text-only answers", f"of {ag['text_total']}"
        out.append(target(name, ag["text_agree"], ">=", min_agree, detail))
    return out


def http_summary(res: dict) -> str:
    """``serve_summary.md`` of the HTTP suite."""
    m, slo = res["meta"], res["meta"]["slo"]
    lines = [
        "# HTTP serving benchmark (`python -m benchmarks serve`)",
        "",
        f"Model `{m['model']}`, scale `{m['scale']}`, {m['threads']} thread(s) per server, "
        f"{m['cpus']} CPUs, load average {m['loadavg_start']} -> {m.get('loadavg_end')}, "
        f"{m.get('total_seconds', 0):.0f} s. Rates (req/s): {', '.join(m['rates'])}. Goodput "
        f"SLO: TTFT <= {slo['ttft_s']:g} s and TPOT <= {slo['tpot_s']:g} s. Every request: "
        "streaming chat completion, images as data URLs, `max_tokens` N with `ignore_eos`, "
        "greedy.",
        "",
        *[f"- {n}" for n in res["notes"]],
        "",
    ]
    if res["targets"]:
        lines += ["## Targets", "", targets_table(res["targets"])]
    if ag := res.get("agreement"):
        items = {i["chat"]: i for i in ag["items"]}
        lines += [
            "## Agreement with llama.cpp (greedy, before timing)",
            "",
            f"Text-only: **{ag['text_agree']}/{ag['text_total']}** equal; images: "
            f"**{ag['image_agree']}/{ag['image_total']}**; passed: {fmt(ag['passed'])}.",
            "",
            table(items, AGREE_COLS),
        ]
    if bounded := {n: w for n, w in res["workloads"].items() if w.get("bound")}:
        servers = sorted({s for w in bounded.values() for s in w["runs"]})
        rows = {}
        for name, w in bounded.items():
            b = rows[name] = dict(w["bound"])
            b["tokens"] = f"{b['distinct_prompt_tokens']} / {b['prompt_tokens']}"
            b["imgs"] = f"{b['distinct_images']} / {b['images']}"
            b["prefill_ms"] = b["prefill_s_per_token"] * 1e3
            b["decode"] = f"{fmt(b['decode_step_s'], 'ms')} ({b['decode_batch']})"
            b["bound"] = f"{b['bound_s']:.2f} ({b['bound_cpu_s']:.2f})"
            for s in servers:
                a = achieved(res, name, s)
                b[s] = f"{fmt(a['wall'], '.2f')} ({fmt(a['cpu'], '.2f')})"
        lines += [
            "## Cost bound",
            "",
            table(rows, BOUND_COLS + "".join(f"|{s} wall (CPU)={s}" for s in servers)),
        ]
    lines += [
        "## Runs",
        "",
        "Times in ms; tok ok: every answer had exactly N tokens.",
        "",
    ]
    for name, w in res["workloads"].items():
        rows = {f"{s}, {rate}": r for s, by in w["runs"].items() for rate, r in by.items()}
        lines += [
            f"### {name}",
            "",
            f"{w['description']}; {w['requests']} requests, N = {w['max_tokens']}.",
            "",
            table(rows, RUN_COLS),
        ]
    if ov := res.get("overhead"):
        ip, st = ov["in_process"], ov["in_process"]["steps"]
        rows = {"in-process": ip, "HTTP": ov["http"]}
        lines += [
            "## HTTP overhead (mmserve, cache on)",
            "",
            f"`{ov['workload']}` at rate `{ov['rate']}`, {ov['pairs']} pairs, medians.",
            "",
            table(rows, "|seconds=wall_s|CPU s=cpu_s|TTFT p50 ms=ttft_p50_s:ms"),
            f"In-process steps: {st['prefill']} prefill {st['prefill_s']:.2f} s, "
            f"{st['decode']} decode {st['decode_s']:.2f} s (mean batch "
            f"{st['decode_rows'] / max(st['decode'], 1):.1f}).",
            "",
            f"Overhead: **{ov['wall_overhead']:+.1%}** wall, "
            f"**{fmt(ov['cpu_overhead'], '+.1%')}** server CPU.",
            "",
        ]
        if p := ov.get("profile"):
            lines += [
                f"Where the non-engine time goes (one more run; {p['note']}):",
                "",
                md_table("category (non-engine threads)|self s", p["categories_s"].items()),
                "Busy seconds per thread: "
                + ", ".join(f"{k} {v:.2f}" for k, v in p["threads_s"].items())
                + f". Largest non-engine item: "
                f"**{p['largest']}**.",
                "",
            ]
    return "\n".join(lines) + "\n"
