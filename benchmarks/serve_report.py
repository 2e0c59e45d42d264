"""Markdown summary, target check and latency plot of :mod:`benchmarks.serve`'s results."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _f(x: Any, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        if math.isinf(x):
            return "inf"
        return format(x, spec)
    return str(x)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def burst_label(by_rate: dict[str, dict]) -> str | None:
    """The key of the burst run, else of the highest finite rate."""
    if "burst" in by_rate:
        return "burst"
    return max(by_rate, key=float) if by_rate else None


def achieved(res: dict, wl: str, server: str) -> dict[str, float | None]:
    """``bound / achieved`` in wall time and in the server's CPU time (burst run)."""
    w = res["workloads"][wl]
    bound = w.get("bound") or {}
    b, bc = bound.get("bound_s"), bound.get("bound_cpu_s")
    runs = w["runs"].get(server) or {}
    key = burst_label(runs)
    if b is None or key is None:
        return {"wall": None, "cpu": None, "rate": key}
    run = runs[key]
    wall = b / run["duration_s"] if run.get("duration_s") else None
    cpu = bc / run["server_cpu_s"] if bc and run.get("server_cpu_s") else None
    return {"wall": wall, "cpu": cpu, "rate": key}


def targets(res: dict, workload: str, fraction: float) -> list[dict]:
    """The issue's target: mmserve (cache on) reaches ``fraction`` of ``workload``'s bound."""
    out = []
    if workload in res["workloads"] and "mmserve" in res["workloads"][workload]["runs"]:
        a = achieved(res, workload, "mmserve")
        for unit in ("wall", "cpu"):
            v = a[unit]
            out.append(
                {
                    "target": f"{workload}: mmserve achieved / bound ({unit} time, "
                    f"{a['rate']} run, HTTP)",
                    "value": v,
                    "threshold": fraction,
                    "met": None if v is None else v >= fraction,
                }
            )
    ag = res.get("agreement")
    if ag:
        out.append(
            {
                "target": "llama.cpp agreement: text-only greedy answers equal (of 10)",
                "value": ag["text_agree"],
                "threshold": 8,
                "met": ag["passed"],
            }
        )
    return out


def plot_latency(path: Path, res: dict) -> Path | None:
    """TTFT p50/p99 and TPOT p50 against offered rate, one column per workload."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    wls = [n for n, w in res["workloads"].items() if w["runs"]]
    if not wls:
        return None
    fig, axes = plt.subplots(2, len(wls), figsize=(4 * len(wls), 6.5), squeeze=False)
    servers = sorted({s for w in res["workloads"].values() for s in w["runs"]})
    colors = {s: f"C{i}" for i, s in enumerate(servers)}
    for j, name in enumerate(wls):
        runs = res["workloads"][name]["runs"]
        finite = sorted({float(k) for r in runs.values() for k in r if k != "burst"} or {1.0})
        burst_x = finite[-1] * 2 if finite else 1.0
        for s, by_rate in runs.items():
            pts = sorted(((burst_x if k == "burst" else float(k)), v) for k, v in by_rate.items())
            xs = [x for x, _ in pts]
            for row, (metric, pct, style) in enumerate(
                [("ttft_s", "p50", "-"), ("tpot_s", "p50", "-")]
            ):
                ax = axes[row][j]
                ys = [v[metric][pct] for _, v in pts]
                ax.plot(xs, ys, style, marker="o", color=colors[s], label=f"{s} {pct}")
                if metric == "ttft_s":
                    ys99 = [v[metric]["p99"] for _, v in pts]
                    ax.plot(xs, ys99, "--", marker="x", color=colors[s], label=f"{s} p99")
        for row, ylabel in enumerate(("TTFT (s)", "TPOT (s)")):
            ax = axes[row][j]
            ax.set_yscale("log")
            ax.set_xscale("log")
            ticks = finite + [burst_x]
            ax.set_xticks(ticks)
            ax.set_xticklabels([f"{t:g}" for t in finite] + ["burst"])
            ax.set_xlabel("offered rate (req/s)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            if row == 0:
                ax.set_title(name)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        f"{res['meta']['model']}, {res['meta']['threads']} thread(s) per server: latency "
        "against offered rate"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_summary(path: Path, res: dict, plot: Path | None) -> str:
    """Write the Markdown summary to ``path`` and return it."""
    m = res["meta"]
    slo = m["slo"]
    lines = [
        "# HTTP serving benchmark (`python -m benchmarks.serve`)",
        "",
        f"Model `{m['model']}`, scale `{m['scale']}`, {m['threads']} thread(s) per server, "
        f"{m['cpus']} CPUs, load average {m['loadavg_start']} -> {m.get('loadavg_end')}, "
        f"{m.get('total_seconds', 0):.0f} s in all. Offered rates (req/s): "
        f"{', '.join(m['rates'])}. SLO for goodput: TTFT <= {slo['ttft_s']:g} s and "
        f"TPOT <= {slo['tpot_s']:g} s. Every request: streaming chat completion, images as "
        "data URLs, `max_tokens` N with `ignore_eos`, greedy.",
        "",
    ]
    for n in res.get("notes", []):
        lines.append(f"- {n}")
    if res.get("notes"):
        lines.append("")
    if res.get("targets"):
        lines += [
            "## Targets",
            "",
            "| target | value | threshold | met |",
            "| --- | --- | --- | --- |",
        ]
        for t in res["targets"]:
            lines.append(
                f"| {t['target']} | {_f(t['value'])} | {t['threshold']} | {_f(t['met'])} |"
            )
        lines.append("")
    lines += _agreement_section(res.get("agreement"))
    lines += _bound_section(res)
    lines += ["## Runs", ""]
    if plot is not None:
        lines += [f"![latency against offered rate]({Path(plot).name})", ""]
    lines += [
        "Times in ms; throughput over the run's span (first send to last answer); "
        "`CPU s`: the server process's CPU time during the run; `tok ok`: every answer "
        "had exactly N tokens (usage).",
        "",
    ]
    for name, w in res["workloads"].items():
        lines += [
            f"### {name}",
            "",
            f"{w['description']}; {w['requests']} requests, N = {w['max_tokens']}.",
            "",
            "| server | rate | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 "
            "| ITL p99 | goodput | hit | CPU s | tok ok |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for s, by_rate in w["runs"].items():
            for rate, r in by_rate.items():
                lines.append(
                    f"| {s} | {rate} | {_f(r['request_throughput'])} | "
                    f"{_f(r['output_throughput'])} | {_ms(r['ttft_s']['p50'])} | "
                    f"{_ms(r['ttft_s']['p99'])} | {_ms(r['tpot_s']['p50'])} | "
                    f"{_ms(r['tpot_s']['p99'])} | {_ms(r['itl_s']['p99'])} | "
                    f"{_f(r['goodput'])} | {_f(r['cache_hit_rate'], '.2f')} | "
                    f"{_f(r['server_cpu_s'])} | {_f(r['token_counts_ok'])} |"
                )
        lines.append("")
    lines += _overhead_section(res.get("overhead"))
    text = "\n".join(lines) + "\n"
    Path(path).write_text(text, encoding="utf-8")
    return text


def _agreement_section(ag: dict | None) -> list[str]:
    if not ag:
        return []
    out = [
        "## Agreement with llama.cpp (greedy, before timing)",
        "",
        f"Text-only chats: **{ag['text_agree']}/{ag['text_total']}** equal (>= 8 needed); "
        f"image chats: **{ag['image_agree']}/{ag['image_total']}** equal; passed: "
        f"{_f(ag['passed'])}. Up to {ag['max_tokens']} tokens, stopping at `</s>`; compared "
        "as token ids (mmserve's engine in-process; llama.cpp's `/completion` with "
        "`return_tokens`); mmserve's engine text equals its HTTP answer: "
        f"{_f(ag.get('engine_equals_http'))}; llama.cpp's `/completion` text equals its chat "
        f"answer in {ag.get('llamacpp_completion_equals_chat')}/{ag.get('items')} (the two "
        "paths render invalid UTF-8 from byte tokens differently).",
        "",
        "| chat | prompt tokens (mmserve, llama.cpp) | equal | reason |",
        "| --- | --- | --- | --- |",
    ]
    for i in ag["text"] + ag["image"]:
        what = i.get("image") or f"text, {i['messages']} messages: {i['prompt'][:40]!r}"
        pt = i["prompt_tokens"]
        out.append(f"| {what} | {pt[0]}, {pt[1]} | {_f(i['agree'])} | {i.get('reason', '')} |")
    return out + [""]


def _bound_section(res: dict) -> list[str]:
    rows = [(n, w) for n, w in res["workloads"].items() if w.get("bound")]
    if not rows:
        return []
    servers = sorted({s for _, w in rows for s in w["runs"]})
    out = [
        "## Cost bound",
        "",
        "The least time any server could take on this machine: distinct (trie) prompt "
        "tokens x per-token prefill cost + distinct images x tower cost + decode steps at "
        "the burst's batch size x step cost, each cost measured in-process on the same "
        "model in this run. `achieved / bound` = bound / the server's time on the burst run "
        "(wall: bound in wall seconds over the run's span; CPU: bound in CPU seconds over "
        "the server process's CPU seconds, the steadier figure on a shared machine), "
        "1.0 = at the bound.",
        "",
        "| workload | distinct / total tokens | distinct / all images | prefill ms/tok | "
        "tower ms/img | decode ms/step (batch) | bound s (CPU s) | max speedup from reuse | "
        + " | ".join(f"{s} wall (CPU)" for s in servers)
        + " |",
        "| --- " * (8 + len(servers)) + "|",
    ]
    for name, w in rows:
        b = w["bound"]
        cells = []
        for s in servers:
            a = achieved(res, name, s)
            cells.append(f"{_f(a['wall'], '.2f')} ({_f(a['cpu'], '.2f')})")
        out.append(
            f"| {name} | {b['distinct_prompt_tokens']} / {b['prompt_tokens']} | "
            f"{b['distinct_images']} / {b['images']} | {b['prefill_s_per_token'] * 1000:.3f} | "
            f"{b['tower_s_per_image'] * 1000:.0f} | {b['decode_step_s'] * 1000:.0f} "
            f"({b['decode_batch']}) | {b['bound_s']:.2f} ({b['bound_cpu_s']:.2f}) | "
            f"{_f(b['max_speedup_from_reuse'])}x | " + " | ".join(cells) + " |"
        )
    return out + [""]


def _overhead_section(ov: dict | None) -> list[str]:
    if not ov:
        return []
    ip, h = ov["in_process"], ov["http"]
    out = [
        "## HTTP overhead (mmserve, cache on)",
        "",
        f"`{ov['workload']}` at rate `{ov['rate']}` (mmserve's highest-throughput run), the "
        "same arrivals through HTTP (the running server, cache flushed) and through an engine "
        "in-process (with the front-end work: image decode + hash, chat template, "
        f"tokenizing), {ov.get('pairs', 1)} back-to-back pairs, medians (HTTP runs: "
        f"{', '.join(f'{x:.2f}' for x in ov.get('http_runs_s', []))} s; in-process: "
        f"{', '.join(f'{x:.2f}' for x in ov.get('in_process_runs_s', []))} s):",
        "",
        "| | seconds | CPU s | TTFT p50 ms |",
        "| --- | --- | --- | --- |",
        f"| in-process | {ip['duration_s']:.2f} | {ip['cpu_s']:.2f} | {_ms(ip['ttft_p50_s'])} |",
        f"| HTTP | {h['duration_s']:.2f} | {_f(h['server_cpu_s'])} | "
        f"{_ms(ov['http_ttft_p50_s'])} |",
        "",
        "In-process engine steps: "
        f"{ip['steps']['prefill']} prefill steps {ip['steps']['prefill_s']:.2f} s, "
        f"{ip['steps']['decode']} decode steps {ip['steps']['decode_s']:.2f} s (mean batch "
        f"{ip['steps']['mean_decode_batch']:.1f}), {ip['vision_tower_images']} tower runs; "
        "the rest of its time is the front-end work. Prefill steps (requests, new tokens, "
        "ms, ms per new token): "
        + "; ".join(
            f"{d['requests']}, {d['new_tokens']}, {d['seconds'] * 1000:.0f}, "
            f"{d['seconds'] * 1000 / max(d['new_tokens'], 1):.2f}"
            for d in ip["steps"].get("prefill_detail", [])
        )
        + ".",
        "",
        f"Overhead: **{ov['wall_overhead']:+.1%}** wall, "
        f"**{_f(ov['cpu_overhead'] * 100 if ov['cpu_overhead'] is not None else None, '+.1f')}%** "
        "server CPU.",
        "",
    ]
    p = ov.get("profile")
    if p:
        out += [
            f"Where it goes (cProfile of the same run, every thread; {p['note']}; profiled run "
            f"{ov.get('profiled_run_s', 0):.1f} s):",
            "",
            "| thread | busy self s |",
            "| --- | --- |",
        ]
        threads = p["threads_s"]
        workers = {t: v for t, v in threads.items() if t.startswith("AnyIO worker")}
        out += [f"| {t} | {v:.2f} |" for t, v in threads.items() if t not in workers]
        if workers:
            out.append(f"| {len(workers)} AnyIO worker threads | {sum(workers.values()):.2f} |")
        out += ["", "| category (non-engine threads) | self s |", "| --- | --- |"]
        out += [f"| {c} | {v:.2f} |" for c, v in p["categories_s"].items()]
        out += ["", "| function (non-engine threads) | self s |", "| --- | --- |"]
        out += [f"| `{fn}` | {v:.3f} |" for fn, v in p["top_functions_s"].items()]
        out += ["", f"Largest non-engine item: **{p['largest']}**.", ""]
        e = p.get("engine_thread")
        if e:
            out += [
                f"Engine thread: {e['step_s']:.2f} s in `Engine.step`, of which model forward "
                f"{e['forward_s']:.2f} s and sampling {e['sampling_s']:.2f} s; "
                f"**{e['outside_share']:.1%}** of step time is outside both.",
                "",
            ]
    return out
