"""The one report: percentiles, Markdown tables, targets and JSON files of every suite.

Inputs are the JSON-ready dicts the suites write (``<workload>.json``, ``pool_sweep.json``,
``serve.json``, ...); nothing here measures anything.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Targets of the in-process suite (ratios or fractions).
SPEEDUP_VS_TRANSFORMERS, SPEEDUP_VS_CACHE_OFF = 6.0, 3.0
HIT_OF_OPTIMUM, HIT_OF_OPTIMUM_HALF_POOL = 0.98, 0.90
MAX_TREE_FRACTION, MIN_ON_OFF_THROUGHPUT = 0.003, 0.98


def percentiles(xs: Sequence[float]) -> dict[str, float | None]:
    """``mean``, ``p50``, ``p90``, ``p99`` of ``xs`` (linear interpolation between order
    statistics, numpy's default); all None for no values."""
    if not len(xs):
        return dict.fromkeys(("mean", "p50", "p90", "p99"))
    s = sorted(float(x) for x in xs)

    def q(p: float) -> float:
        k = (len(s) - 1) * p / 100
        lo = math.floor(k)
        return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)

    return {"mean": sum(s) / len(s), "p50": q(50), "p90": q(90), "p99": q(99)}


def fmt(x: Any, spec: str = ".3g") -> str:
    """``x`` for a table: "-" for None, yes/NO for booleans, ``spec`` for floats."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return "inf" if math.isinf(x) else format(x, spec)
    return str(x)


def ms(x: float | None) -> str:
    """Seconds as whole milliseconds ("-" for None)."""
    return "-" if x is None else f"{x * 1000:.0f}"


def md_table(head: str | Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; ``head`` is a sequence or "|"-separated; cells go through :func:`fmt`."""
    head = head.split("|") if isinstance(head, str) else head
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def ratio_table(keys: Sequence[str], on: dict, off: dict) -> str:
    """Plain-text table of ``keys`` with the caches on, off, and on / off."""
    lines = [f"{'':<22}{'cache on':>12}{'cache off':>12}{'on/off':>10}"]
    for k in keys:
        a, b = on[k], off[k]
        r = f"{a / b:>9.2f}x" if b else f"{'-':>10}"
        lines.append(f"{k:<22}{fmt(a, '.4g'):>12}{fmt(b, '.4g'):>12}{r}")
    return "\n".join(lines)


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON; NaN becomes null and infinity "inf"."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None if math.isnan(x) else "inf"
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        return [clean(v) for v in x] if isinstance(x, list | tuple) else x

    Path(path).write_text(json.dumps(clean(obj), indent=2, default=str) + "\n", encoding="utf-8")


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
    """The in-process suite's targets on the measured figures.

    Args:
        results: per-workload result dicts by workload name; sweeps: pool sweeps by workload.
        policy: the cache-on policy the targets refer to.
    """
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


def pick(d: dict, keys: str) -> list:
    """``d``'s values for the space-separated ``keys``."""
    return [d[k] for k in keys.split()]


def workload_table(res: dict) -> str:
    """One workload's systems, with ratios against transformers (a) and cache-off (b)."""
    a, b = _system(res, "transformers"), _system(res, "mmserve-off")
    opt = res["prompts"]["optimal_hit_rate"]
    rows = []
    for s in res["systems"]:
        cmp = res.get("comparisons", {}).get(s["system"], {})
        row = [s["system"] + (" *" if s["measured_requests"] < s["requests"] else "")]
        row += pick(s, "requests_per_s requests_per_cpu_s output_tokens_per_s")
        row += pick(s, "ttft_p50_s ttft_p99_s") + [fmt(s["cache_hit_rate"], ".4f")]
        row += [fmt(s["cache_hit_rate"] / opt if opt else None, ".3f"), s["vision_tower_runs"]]
        row += [fmt(100 * s["tree_fraction"], ".3f") if s["kind"] == "mmserve" else None]
        for k in ("requests_per_s", "requests_per_cpu_s"):
            row += [fmt(s[k] / ref[k] if ref else None, ".2f") for ref in (a, b)]
        rows.append(row + [cmp.get("mismatches_vs_off"), cmp.get("agree_with_transformers")])
    head = "system|req/s|req/CPU-s|out tok/s|TTFT p50 (s)|TTFT p99 (s)|hit|hit/opt|vision runs"
    head += "|tree time %|x (a)|x (b)|x (a) CPU|x (b) CPU|mismatch vs (b)|agree (a)"
    return md_table(head, rows)


def sweep_table(sweep: dict) -> str:
    """The KV-pool sweep of one workload."""
    ws, opt = sweep["working_set_tokens"], sweep["optimal_hit_rate"]
    rows = []
    for p in sweep["points"]:
        row = [p["pool_tokens"], fmt(p["pool_tokens"] / ws, ".3f")]
        row += [fmt(p["cache_hit_rate"], ".4f"), fmt(p["cache_hit_rate"] / opt, ".3f")]
        keys = "requests_per_s requests_per_cpu_s ttft_p50_s retractions all_finished"
        rows.append(row + pick(p, keys + " output_mismatches leak_free"))
    head = "pool (tokens)|pool / working set|hit rate|hit/opt|req/s|req/CPU-s|TTFT p50 (s)"
    return md_table(head + "|retractions|finished|mismatch vs uncached|leak-free", rows)


def engine_summary(results: dict, sweeps: dict, targets: list[dict], meta: dict) -> str:
    """``summary.md`` of the in-process suite."""
    m = meta
    lines = ["# mmserve benchmark summary (in-process)", ""]
    lines += [
        f"- model `{m['model']}`, torch threads {m['threads']}, scale {m['scale']}, seed "
        f"{m['seed']}; {m['total_seconds']:.1f} s; load average {m['loadavg_start']} -> "
        f"{m['loadavg_end']} (other load inflates wall times, not the CPU-time figures)",
        "- (a) = transformers `generate`, one request at a time; (b) = `mmserve-off` (radix "
        "and vision-embedding caches off); `mmserve-<policy>` = caches on. Same prompts, "
        "greedy, `max_tokens` tokens each; TTFT from submission (queueing included).",
        "- `*` = subsampled; hit/opt = hit rate / offline optimum (SGLang Theorem 3.1); "
        "mismatch = requests whose tokens differ from (b); agree (a) = equal to transformers'.",
    ]
    lines += ["", "## Targets", "", targets_table(targets)]
    for name, res in results.items():
        pr = res["prompts"]
        lines += [f"## {name}", ""]
        lines += [
            f"{res['description']}. {pr['requests']} requests, {pr['total_tokens']} prompt "
            f"tokens, {pr['distinct_tokens']} distinct, optimum {pr['optimal_hit_rate']:.4f}, "
            f"working set {pr['working_set_tokens']} tokens."
        ]
        notes = res.get("notes", []) + res.get("skipped", [])
        notes += [f"{s['system']}: {n}" for s in res["systems"] for n in s.get("notes", [])]
        lines += ["", workload_table(res)] + [f"- {n}" for n in notes] + [""]
    for sw in sweeps.values():
        lines += [f"## KV pool sweep ({sw['workload']}, policy {sw['policy']})", ""]
        lines += [
            f"Working set {sw['working_set_tokens']} tokens, one request "
            f"{sw['one_request_tokens']}.",
            "",
            sweep_table(sw),
        ]
    return "\n".join(lines) + "\n"


# ---- HTTP suite --------------------------------------------------------------------------


def burst_key(by_rate: dict[str, dict]) -> str | None:
    """The burst run's key, else the highest finite rate's."""
    return "burst" if "burst" in by_rate else max(by_rate, key=float, default=None)


def achieved(res: dict, wl: str, server: str) -> dict[str, Any]:
    """``bound / the server's time`` on the burst run, in wall and in server CPU seconds."""
    w = res["workloads"][wl]
    bound, runs = w.get("bound") or {}, w["runs"].get(server) or {}
    key = burst_key(runs)
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
    lines = ["# HTTP serving benchmark (`python -m benchmarks serve`)", ""]
    lines += [
        f"Model `{m['model']}`, scale `{m['scale']}`, {m['threads']} thread(s) per server, "
        f"{m['cpus']} CPUs, load average {m['loadavg_start']} -> {m.get('loadavg_end')}, "
        f"{m.get('total_seconds', 0):.0f} s. Rates (req/s): {', '.join(m['rates'])}. Goodput "
        f"SLO: TTFT <= {slo['ttft_s']:g} s and TPOT <= {slo['tpot_s']:g} s. Every request: "
        "streaming chat completion, images as data URLs, `max_tokens` N with `ignore_eos`, "
        "greedy.",
        "",
    ]
    lines += [f"- {n}" for n in res.get("notes", [])] + [""]
    if res.get("targets"):
        lines += ["## Targets", "", targets_table(res["targets"])]
    if ag := res.get("agreement"):
        lines += ["## Agreement with llama.cpp (greedy, before timing)", ""]
        lines += [
            f"Text-only: **{ag['text_agree']}/{ag['text_total']}** equal; images: "
            f"**{ag['image_agree']}/{ag['image_total']}**; passed: {fmt(ag['passed'])}. "
            "Compared as token ids (mmserve's engine in-process, its text checked equal "
            "to its HTTP answer; llama.cpp's `/completion` with `return_tokens`).",
            "",
        ]
        rows = [pick(i, "chat prompt_tokens agree") + [i.get("reason", "")] for i in ag["items"]]
        lines.append(md_table("chat|prompt tokens (mmserve, llama.cpp)|equal|reason", rows))
    if bounded := [(n, w) for n, w in res["workloads"].items() if w.get("bound")]:
        servers = sorted({s for _, w in bounded for s in w["runs"]})
        rows = []
        for name, w in bounded:
            b = w["bound"]
            row = [name, f"{b['distinct_prompt_tokens']} / {b['prompt_tokens']}"]
            row += [f"{b['distinct_images']} / {b['images']}"]
            row += [fmt(b["prefill_s_per_token"] * 1e3, ".3f"), ms(b["tower_s_per_image"])]
            row += [f"{ms(b['decode_step_s'])} ({b['decode_batch']})"]
            row += [f"{b['bound_s']:.2f} ({b['bound_cpu_s']:.2f})", b["max_speedup_from_reuse"]]
            for a in (achieved(res, name, s) for s in servers):
                row.append(f"{fmt(a['wall'], '.2f')} ({fmt(a['cpu'], '.2f')})")
            rows.append(row)
        head = "workload|distinct / total tokens|distinct / all images|prefill ms/tok"
        head += "|tower ms/img|decode ms/step (batch)|bound s (CPU s)|max speedup from reuse"
        head += "".join(f"|{s} wall (CPU)" for s in servers)
        lines += ["## Cost bound", ""]
        lines += [
            "The least time any server could take here (see `cost_bound.py`); "
            "`achieved / bound` = bound / the server's time on the burst run, wall "
            "(CPU: bound CPU s / server CPU s); 1.0 = at the bound.",
            "",
            md_table(head, rows),
        ]
    lines += ["## Runs", ""]
    lines += [
        "Times in ms; throughput over the first send to the last answer; CPU s: the "
        "server process's; tok ok: every answer had exactly N tokens.",
        "",
    ]
    head = "server|rate|req/s|out tok/s|TTFT p50|TTFT p99|TPOT p50|TPOT p99|ITL p99|goodput"
    for name, w in res["workloads"].items():
        rows = []
        for s, by_rate in w["runs"].items():
            for rate, r in by_rate.items():
                row = [s, rate, r["request_throughput"], r["output_throughput"]]
                row += [ms(r[k][p]) for k, p in (("ttft_s", "p50"), ("ttft_s", "p99"))]
                row += [ms(r["tpot_s"]["p50"]), ms(r["tpot_s"]["p99"]), ms(r["itl_s"]["p99"])]
                row += [r["goodput"], fmt(r["cache_hit_rate"], ".2f")]
                rows.append(row + pick(r, "server_cpu_s token_counts_ok"))
        lines += [f"### {name}", ""]
        lines += [f"{w['description']}; {w['requests']} requests, N = {w['max_tokens']}.", ""]
        lines.append(md_table(head + "|hit|CPU s|tok ok", rows))
    if ov := res.get("overhead"):
        ip, st, h = ov["in_process"], ov["in_process"]["steps"], ov["http"]
        rows = [("in-process", ip["wall_s"], ip["cpu_s"], ms(ip["ttft_p50_s"]))]
        rows += [("HTTP", h["duration_s"], h["server_cpu_s"], ms(ov["http_ttft_p50_s"]))]
        lines += ["## HTTP overhead (mmserve, cache on)", ""]
        lines += [
            f"`{ov['workload']}` at rate `{ov['rate']}` (mmserve's peak run), the same "
            "arrivals through HTTP (cache flushed) and through an in-process engine doing "
            f"the front-end work, {ov['pairs']} back-to-back pairs, medians.",
            "",
            md_table("|seconds|CPU s|TTFT p50 ms", rows),
            f"In-process steps: {st['prefill']} prefill {st['prefill_s']:.2f} s, "
            f"{st['decode']} decode {st['decode_s']:.2f} s (mean batch "
            f"{st['decode_rows'] / max(st['decode'], 1):.1f}).",
            "",
            f"Overhead: **{ov['wall_overhead']:+.1%}** wall, "
            f"**{fmt(ov['cpu_overhead'], '+.1%')}** server CPU.",
            "",
        ]
        if p := ov.get("profile"):
            rows = [(c, fmt(v, ".2f")) for c, v in p["categories_s"].items()]
            lines += [f"Where the non-engine time goes (one more run; {p['note']}):", ""]
            lines += [md_table("category (non-engine threads)|self s", rows)]
            lines += [f"Largest non-engine item: **{p['largest']}**.", ""]
            if e := p.get("engine_thread"):
                lines += [
                    f"Engine thread: {e['step_s']:.2f} s in `Engine.step`, model forward "
                    f"{e['forward_s']:.2f} s, sampling {e['sampling_s']:.2f} s: "
                    f"**{e['outside_share']:.1%}** of step time outside both.",
                    "",
                ]
    return "\n".join(lines) + "\n"


def real_shapes_table(results: dict[str, dict]) -> str:
    """``real-shapes --parts compare``: transformers and mmserve per dtype."""
    rows = []
    for dtype, r in results.items():
        for label, k, unit, x in (
            ("first question (tower + prefill)", "first", "s", 1),
            ("second question, same photo", "second", "s", 1),
            ("decode, batch 1", "decode", "ms/token", 1e3),
            ("decode, batch 1, CPU time", "decode_cpu", "ms/token", 1e3),
        ):
            hf, mm = r[f"hf_{k}"] * x, r[f"mm_{k}"] * x
            rows.append(
                (f"{label}, {dtype}", f"{hf:.3g} {unit}", f"{mm:.3g} {unit}", f"{mm / hf:.2f}")
            )
        for suffix, what in (("", "tokens/s"), ("_cpu", "tokens per CPU second")):
            b, one = r["mm_batch_tps" + suffix], r["mm_single_tps" + suffix]
            label = f"{r['batch']} concurrent answers vs batch 1 ({what}), {dtype}"
            rows.append((label, "-", f"{b:.1f} vs {one:.1f}", f"{b / one:.2f}x"))
    return md_table("|transformers|mmserve|mmserve / transformers", rows)


def decode_table(sweeps: list[dict]) -> str:
    """``real-shapes --parts decode``: ms per step (CPU in brackets) against the bound."""
    rows, lines = [], []
    for sw in sweeps:
        bound, bound_cpu = sw["bound_ms"], sw["bound_cpu_ms"]
        for b, r in sw["batches"].items():
            rows.append(
                (
                    sw["dtype"],
                    b,
                    f"{r['hf']:.1f} ({r['hf_cpu']:.1f})",
                    f"{r['mm']:.1f} ({r['mm_cpu']:.1f})",
                )
                + (
                    f"{r['mm'] / r['hf']:.2f} ({r['mm_cpu'] / r['hf_cpu']:.2f})",
                    f"{r['mm'] / int(b):.1f}",
                )
                + (
                    f"{bound:.1f} ({bound_cpu:.1f})",
                    f"{r['mm'] / bound:.2f} ({r['mm_cpu'] / bound_cpu:.2f})",
                )
            )
        lines.append(
            f"{sw['dtype']}: read bandwidth {sw['bandwidth_gbs']:.1f} GB/s "
            f"({sw['bandwidth_cpu_gbs']:.1f} per CPU second), decode weights "
            f"{sw['weight_bytes'] / 1e9:.3f} GB"
        )
        if d := sw.get("default"):
            lines.append(
                f"default server dtype ({d['dtype']}): batch-1 decode {d['ms']:.1f} ms (CPU "
                f"{d['cpu_ms']:.1f}) vs --dtype {sw['dtype']} {d['explicit_ms']:.1f} (CPU "
                f"{d['explicit_cpu_ms']:.1f}), alternating: {d['ms'] / d['explicit_ms']:.2f}x"
            )
    head = "dtype|batch|transformers ms/step (CPU)|mmserve ms/step (CPU)|mmserve / transformers"
    head += "|mmserve ms/token|bound ms/step (CPU)|mmserve / bound"
    return md_table(head, rows) + "\n".join(lines)


def tiers_summary(out: dict) -> str:
    """``kv-tiers``: the setups side by side, the restart and the TTFT from disk."""
    opt, off = out["optimum"]["cache_hit_rate"], out["off"]["requests_per_s"]
    rows = [
        (name, f"{f['cache_hit_rate']:.3f}", f"{f['cache_hit_rate'] / opt:.3f}")
        + (f"{f['requests_per_s']:.2f}", f"{f['requests_per_s'] / off:.2f}x")
        + (f"{f['ttft_p50_ms']:.0f}", f"{f['ttft_p90_ms']:.0f}", f["vision_tower_runs"])
        for name, f in out.items()
        if name in ("off", "host", "disk", "optimum")
    ]
    head = "setup|hit rate|/ optimum|req/s|vs off|TTFT p50 ms|p90 ms|tower runs"
    r, t = out["restart"], out["ttft"]
    return md_table(head, rows) + (
        f"restart: {r['image_tokens_cached_share']:.3f} of the image tokens of {r['images']} "
        f"photos cached, tower runs {r['vision_tower_runs']}, feature loads {r['feature_loads']}"
        f"\nTTFT, new question about a photo on disk: {t['disk_ttft_p50_ms']:.0f} ms vs "
        f"recompute {t['recompute_ttft_p50_ms']:.0f} ms (p50 of {t['images']}): "
        f"{t['speedup_p50']:.1f}x; tower runs {t['disk_tower_runs']} vs "
        f"{t['recompute_tower_runs']}; first tokens equal: {t['first_tokens_equal']}"
    )


def replicas_table(results: dict) -> str:
    """The replica setups side by side (``python -m benchmarks replicas``)."""
    w = results["workload"]
    rows = []
    for name, r in results["setups"].items():
        row = [name, fmt(r["hit_rate"], ".3f"), fmt(r["hit_rate_over_optimum"] or 0.0, ".3f")]
        row += [fmt(r["tower_runs_per_image"], ".2f"), r["pixel_fetches"]]
        row += [fmt(r["requests_per_second"], ".2f"), fmt(r["output_tokens_per_second"], ".1f")]
        row += [fmt(r["ttft_p50_ms"], ".0f"), fmt(r["ttft_p99_ms"], ".0f"), r["errors"]]
        rows.append(row + [", ".join(f"{k} {v}" for k, v in sorted(r.get("router", {}).items()))])
    head = "setup|hit rate|hit / optimum|tower runs / image|pixel fetches|req/s|output tok/s"
    return (
        f"# Replica routing benchmark\n\n{w['requests']} requests ({w['images']} images x "
        f"{w['questions']} questions + {w['sessions']} sessions x {w['turns']} turns) from "
        f"{w['concurrency']} clients, {w['max_tokens']} tokens each, {w['distinct_images']} "
        f"distinct images, offline-optimal hit rate {w['optimal_hit_rate']:.3f}; model "
        f"`{Path(results['model']).name}`.\n\n"
        + md_table(head + "|TTFT p50 ms|TTFT p99 ms|errors|routed", rows)
    )
