"""``python -m benchmarks plot RESULTS_DIR``: PNG plots from the JSON the benchmarks write.

Each plot reads the files one subcommand writes into its ``--out`` folder and is skipped,
with a note saying which file is missing, when the folder has none:

========================  ===================================================================
``serve.png``             ``serve.json`` (``serve``): TTFT p50, TPOT p50 and req/s against
                          the offered rate, per workload, one line per server
``kv_pool.png``           ``kv_tiers*.json`` (``kv-tiers``, one file per ``--pool-images``):
                          hit rate against the KV pool size, tiers off / host / disk; and
                          ``pool_sweep.json`` (``run``): hit rate against pool size per workload
``decode.png``            ``real_shapes.json`` (``real-shapes --parts decode[,quant]``): decode
                          tokens/s against batch size per dtype (and int8), next to the
                          weight-reading bound, per CPU second and per wall second
``host.png``              ``host.json`` (``host``, issue 41; shape in :data:`HOST_SHAPE`):
                          server over HTTP / engine alone tokens/s against concurrency
``replicas.png``          ``replicas.json`` (``replicas``): hit rate and tower runs per image
                          of each setup, by router
========================  ===================================================================

A result file may carry a top-level ``"source"`` string (where its figures came from, e.g.
a table of benchmarks/README.md); it is printed under the plot. matplotlib comes with the
``bench`` extra (``pip install -e ".[bench]"``); the Agg backend draws without a display.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The JSON ``python -m benchmarks host`` (issue 41) writes as ``host.json``; :func:`host`
#: reads ``runs`` (``ratio`` is computed from the two tokens/s when absent; ``mode`` is
#: "streamed" or "plain"; the CPU figures are for the table, not the plot).
HOST_SHAPE: dict[str, Any] = {
    "meta": {"model": "tiny", "cpus": 2, "threads": 1, "tokens": 128, "pairs": 3},
    "runs": [
        {
            "concurrency": 128,
            "mode": "streamed",
            "engine_tokens_per_s": 2000.0,
            "server_tokens_per_s": 940.0,
            "ratio": 0.47,
            "api_cpu_us_per_token": 125.0,
            "engine_cpu_us_per_token": 227.0,
        }
    ],
}
#: Targets of issue 41 (server / engine tokens/s), drawn as lines on the host plot.
HOST_TARGETS = {"streamed": 0.85, "plain": 0.9}
#: Display names and colours of the servers of ``serve`` (others get the next colours).
SERVER_STYLE = {
    "mmserve": ("mmserve (cache on)", "tab:blue"),
    "mmserve-off": ("mmserve, cache off", "tab:orange"),
    "llamacpp": ("llama.cpp", "tab:green"),
}
#: ``serve``'s metrics: (panel title, y label, path into a run, scale).
SERVE_METRICS = (
    ("TTFT p50", "TTFT p50 (ms)", ("ttft_s", "p50"), 1e3),
    ("TPOT p50", "TPOT p50 (ms)", ("tpot_s", "p50"), 1e3),
    ("throughput", "throughput (req/s)", ("request_throughput",), 1.0),
)
#: ``kv-tiers`` setups: (colour, line style); host and disk often coincide, so they differ
#: in marker size and dash too.
TIER_STYLE = {
    "off": ("tab:gray", "o-", 7),
    "host": ("tab:blue", "o-", 10),
    "disk": ("tab:green", "s--", 5),
}


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend.

    Raises:
        SystemExit: matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        msg = 'python -m benchmarks plot needs matplotlib: pip install -e ".[bench]"'
        raise SystemExit(msg) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _load(path: Path) -> dict | None:
    """The JSON object at ``path``, or None when there is no such file."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _num(x: Any) -> float | None:
    """A finite float of ``x`` ("inf" and None give None)."""
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _dig(d: Any, path: tuple[str, ...]) -> Any:
    for p in path:
        d = d.get(p) if isinstance(d, dict) else None
    return d


def _finish(plt: Any, fig: Any, out: Path, sources: list[str]) -> Path:
    """Footer (the sources, wrapped to the figure's width), layout, PNG at 110 dpi; returns
    ``out``."""
    width, height = fig.get_size_inches()
    lines = [x for s in sources for x in textwrap.wrap(s, int(width * 17))]
    fig.text(0.01, 0.005, "\n".join(lines), fontsize=7, va="bottom", color="0.3")
    fig.tight_layout(rect=(0, (len(lines) * 0.13 + 0.05) / height, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _source(name: str, data: dict, meta: dict | None = None) -> str:
    """One footer line: the file, its ``source`` and what its metadata says of the machine."""
    meta = meta or data.get("meta") or {}
    bits = [f"{k} {meta[k]}" for k in ("model", "scale", "cpus", "threads") if meta.get(k)]
    line = name + (f" ({', '.join(bits)})" if bits else "")
    return line + (f": {data['source']}" if data.get("source") else "")


def _rate_key(label: str) -> float:
    return math.inf if label in ("burst", "inf") else float(label)


def serve(results: Path, out: Path) -> Path | str:
    """``serve.png``: per workload (rows), TTFT p50, TPOT p50 and req/s (columns) against
    the offered rate (req/s; a burst is the last tick), one line per server."""
    res = _load(results / "serve.json")
    if res is None:
        return "serve.json not found (python -m benchmarks serve)"
    wls = {n: w for n, w in res.get("workloads", {}).items() if w.get("runs")}
    if not wls:
        return "serve.json has no runs"
    plt = _pyplot()
    fig, axes = plt.subplots(len(wls), 3, figsize=(13, 2.9 * len(wls) + 0.8), squeeze=False)
    extra = iter(("tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive"))
    styles = dict(SERVER_STYLE)
    for row, (name, w) in zip(axes, wls.items(), strict=True):
        labels = sorted({r for by in w["runs"].values() for r in by}, key=_rate_key)
        for server, by in w["runs"].items():
            shown, color = styles.setdefault(server, (server, next(extra, "black")))
            for ax, (_, _, path, scale) in zip(row, SERVE_METRICS, strict=True):
                pts = [(labels.index(k), _num(_dig(r, path))) for k, r in by.items()]
                pts = sorted((x, y * scale) for x, y in pts if y is not None)
                if pts:
                    ax.plot(*zip(*pts, strict=True), "o-", color=color, label=shown)
        for ax, (title, ylabel, _, _) in zip(row, SERVE_METRICS, strict=True):
            ax.set_xticks(range(len(labels)), labels)
            ax.set_xlim(-0.4, len(labels) - 0.6)
            ax.set_ylim(bottom=0)
            ax.set_xlabel("offered rate (req/s)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{name} ({w.get('requests', '?')} requests): {title}", fontsize=9)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=8)
    fig.suptitle("HTTP serving benchmark (serve): latency and throughput against offered load")
    return _finish(plt, fig, out / "serve.png", [_source("serve.json", res)])


def kv_pool(results: Path, out: Path) -> Path | str:
    """``kv_pool.png``: hit rate against the KV pool (tokens): the ``kv-tiers`` runs (one
    file per pool size) with tiers off, host and disk, and the optimum; beside it
    ``run``'s pool sweep per workload."""
    tiers = [(p.name, d) for p in sorted(results.glob("kv_tiers*.json")) if (d := _load(p))]
    tiers = [(n, d) for n, d in tiers if _num(_dig(d, ("off", "pool_tokens")))]
    sweep = _load(results / "pool_sweep.json") or {}
    if not tiers and not sweep:
        return "no kv_tiers*.json nor pool_sweep.json (python -m benchmarks kv-tiers / run)"
    plt = _pyplot()
    panels = int(bool(tiers)) + int(bool(sweep))
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8), squeeze=False)
    axs, sources = list(axes[0]), []
    if tiers:
        ax = axs.pop(0)
        tiers.sort(key=lambda nd: nd[1]["off"]["pool_tokens"])
        for setup, (color, style, size) in TIER_STYLE.items():
            pts = [(d[setup]["pool_tokens"], d[setup]["cache_hit_rate"]) for _, d in tiers]
            ax.plot(*zip(*pts, strict=True), style, color=color, ms=size, label=f"tiers: {setup}")
        opt = max(d["optimum"]["cache_hit_rate"] for _, d in tiers if "optimum" in d)
        ax.axhline(opt, ls="--", color="black", lw=1, label=f"optimum ({opt:.3f})")
        _hit_rate_axes(ax, "kv-tiers: hit rate against pool size, tiers off / host / disk")
        names = ", ".join(n for n, _ in tiers)
        src = next((d["source"] for _, d in tiers if d.get("source")), "")
        sources.append(names + (f": {src}" if src else ""))
    if sweep:
        ax = axs.pop(0)
        for i, (name, sw) in enumerate(sweep.items()):
            if name in ("source", "meta") or not isinstance(sw, dict):
                continue
            pts = sorted((p["pool_tokens"], p["cache_hit_rate"]) for p in sw["points"])
            color = f"C{i}"
            ax.plot(*zip(*pts, strict=True), "o-", color=color, label=name)
            if (opt := sw.get("optimal_hit_rate")) is not None:
                ax.axhline(opt, ls="--", color=color, lw=1, label=f"{name} optimum ({opt:.3f})")
        _hit_rate_axes(ax, "run: KV-pool sweep, no tiers (policy lpm)")
        sources.append(_source("pool_sweep.json", sweep))
    fig.suptitle("Prefix-cache hit rate against KV pool size")
    return _finish(plt, fig, out / "kv_pool.png", sources)


def _hit_rate_axes(ax: Any, title: str) -> None:
    """Hit rate (0..1) against KV pool tokens on a log-2 axis, titled, gridded, with a legend."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV pool (tokens, log scale)")
    ax.set_ylabel("cache hit rate (cached / prompt tokens)")
    ax.set_ylim(-0.02, 1.0)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)


def decode(results: Path, out: Path) -> Path | str:
    """``decode.png``: decode tokens/s (batch / step time) against batch size, per CPU
    second and per wall second: mmserve and transformers per dtype, int8 (the quant part),
    and each one's weight-reading bound (weight bytes / measured read bandwidth per step)."""
    res = _load(results / "real_shapes.json")
    sweeps = (res or {}).get("decode") or []
    if not sweeps:
        return "real_shapes.json with a decode part not found (real-shapes --parts decode)"
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    bw: dict[str, dict[str, float]] = {}
    for i, sw in enumerate(sweeps):
        color, dt = f"C{i}", sw["dtype"]
        bs = sorted(sw["batches"], key=int)
        bw[dt] = {"": sw["bandwidth_gbs"], "_cpu": sw["bandwidth_cpu_gbs"]}
        for ax, unit in zip(axes, ("_cpu", ""), strict=True):
            xs = [int(b) for b in bs]
            for side, style, who in (("mm", "o-", "mmserve"), ("hf", "x--", "transformers")):
                ys = [int(b) * 1e3 / sw["batches"][b][side + unit] for b in bs]
                ax.plot(xs, ys, style, color=color, label=f"{who}, {dt}")
            bound = sw["bound" + unit + "_ms"]
            ax.plot(xs, [x * 1e3 / bound for x in xs], ":", color=color, lw=2,
                    label=f"bound, {dt} ({sw['weight_bytes'] / 1e9:.2f} GB/step)")  # fmt: skip
    for j, q in enumerate((res or {}).get("quant") or []):
        ms, b, color = q["ms"], q["batch"], f"C{len(sweeps) + j}"
        wb, dt = q["weight_bytes"]["int8"], q["dtype"]
        for ax, unit in zip(axes, ("_cpu", ""), strict=True):
            xs = [1, b]
            ys = [x * 1e3 / ms[f"int8_b{x}{unit}"] for x in xs]
            ax.plot(xs, ys, "s-", color=color, label=f"mmserve, int8 weights ({dt}; quant run)")
            if gbs := bw.get(dt, {}).get(unit):
                ax.plot(xs, [x * gbs * 1e9 / wb for x in xs], ":", color=color, lw=2,
                        label=f"bound, int8 ({wb / 1e9:.2f} GB/step)")  # fmt: skip
    for ax, what in zip(axes, ("per CPU second", "per wall second"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted({int(b) for sw in sweeps for b in sw["batches"]}))
        ax.xaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("batch size (concurrent answers)")
        ax.set_ylabel(f"decode tokens {what} (log scale)")
        ax.set_title(f"decode tokens {what}; dotted: weight-reading bound", fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    model = Path(str((res or {}).get("model", ""))).name
    fig.suptitle(f"Decode throughput against batch size (real-shapes, {model})")
    meta = {"model": model, "threads": (res or {}).get("threads")}
    return _finish(plt, fig, out / "decode.png", [_source("real_shapes.json", res or {}, meta)])


def host(results: Path, out: Path) -> Path | str:
    """``host.png``: server over HTTP / engine alone (tokens/s) against concurrency, per
    mode (streamed, plain), with issue 41's targets; from ``host.json`` (:data:`HOST_SHAPE`)."""
    res = _load(results / "host.json")
    if res is None:
        return "host.json not found (python -m benchmarks host, issue 41)"
    by: dict[str, list[tuple[float, float]]] = {}
    for r in res.get("runs", []):
        ratio = _num(r.get("ratio"))
        if ratio is None and _num(r.get("engine_tokens_per_s")):
            ratio = r["server_tokens_per_s"] / r["engine_tokens_per_s"]
        if ratio is not None:
            by.setdefault(r.get("mode", "streamed"), []).append((r["concurrency"], ratio))
    if not by:
        return "host.json has no runs"
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for i, (mode, pts) in enumerate(sorted(by.items())):
        ax.plot(*zip(*sorted(pts), strict=True), "o-", color=f"C{i}", label=mode)
        if mode in HOST_TARGETS:
            ax.axhline(HOST_TARGETS[mode], ls=":", color=f"C{i}", label=f"target, {mode}")
    ax.axhline(1.0, ls="--", color="black", lw=1, label="engine alone (1.0)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({c for pts in by.values() for c, _ in pts}))
    ax.xaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("server over HTTP / engine alone (tokens/s)")
    ax.set_title("Host path: what the server delivers of its engine's tokens/s", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _finish(plt, fig, out / "host.png", [_source("host.json", res)])


def replicas(results: Path, out: Path) -> Path | str:
    """``replicas.png``: hit rate (against the offline optimum) and tower runs per image of
    each setup of ``replicas``, bars coloured by router."""
    res = _load(results / "replicas.json")
    if res is None or not res.get("setups"):
        return "replicas.json not found (python -m benchmarks replicas)"
    plt = _pyplot()
    setups = res["setups"]
    names = list(setups)
    routers = sorted({s["router_policy"] for s in setups.values()})
    color = {r: f"C{i}" for i, r in enumerate(routers)}
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 0.55 * len(names) + 2.2), sharey=True)
    ys = range(len(names))
    for ax, key in ((a, "hit_rate"), (b, "tower_runs_per_image")):
        vals = [setups[n][key] for n in names]
        bars = ax.barh(ys, vals, color=[color[setups[n]["router_policy"]] for n in names])
        for bar, n in zip(bars, names, strict=True):
            if setups[n].get("encoders"):
                bar.set_hatch("//")
        ax.bar_label(bars, [f"{v:.3f}" if key == "hit_rate" else f"{v:.2f}" for v in vals],
                     fontsize=8, padding=2)  # fmt: skip
        ax.grid(alpha=0.3, axis="x")
    a.set_yticks(list(ys), names)
    a.invert_yaxis()
    if (opt := _num(_dig(res, ("workload", "optimal_hit_rate")))) is not None:
        a.axvline(opt, ls="--", color="black", lw=1, label=f"offline optimum ({opt:.3f})")
    a.set_xlim(0, 1.0)
    a.set_xlabel("cache hit rate (cached / prompt tokens)")
    a.set_title("hit rate per setup", fontsize=9)
    b.set_xlabel("vision-tower runs per distinct image")
    b.set_title("tower runs per image (hatched: 1 shared encoder)", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[r]) for r in routers]
    lines, texts = a.get_legend_handles_labels()
    # on the tower-runs panel: its bars end at half its width, the hit-rate bars do not
    b.legend(handles + lines, [f"router: {r}" for r in routers] + texts, fontsize=8,
             loc="lower right")  # fmt: skip
    fig.suptitle("Replicas (Ray Serve): hit rate and tower runs by router")
    meta = {"model": Path(str(res.get("model", ""))).name, "scale": res.get("scale")}
    return _finish(plt, fig, out / "replicas.png", [_source("replicas.json", res, meta)])


#: Every plot: (name, function of ``(results dir, output dir)`` -> PNG path or a note).
PLOTS: tuple[tuple[str, Callable[[Path, Path], Path | str]], ...] = (
    ("serve", serve),
    ("kv_pool", kv_pool),
    ("decode", decode),
    ("host", host),
    ("replicas", replicas),
)


def plot_all(results: Path, out: Path | None = None) -> dict[str, Path | str]:
    """Every plot of :data:`PLOTS` from the JSON in ``results`` into ``out`` (default
    ``results``); returns plot name -> the PNG written, or a note why it was skipped.

    Raises:
        FileNotFoundError: ``results`` is not a folder.
        SystemExit: matplotlib is not installed (and some plot had data).
    """
    if not Path(results).is_dir():
        raise FileNotFoundError(f"{results}: no such results folder")
    out = Path(out or results)
    out.mkdir(parents=True, exist_ok=True)
    return {name: fn(Path(results), out) for name, fn in PLOTS}


def main(results: Path, out: Path | None) -> int:
    """``python -m benchmarks plot``: prints each plot's file or why it was skipped;
    returns 0 when at least one plot was drawn, else 1."""
    try:
        done = plot_all(results, out)
    except FileNotFoundError as e:
        print(e)
        return 1
    for name, got in done.items():
        print(f"{name}: {got}" if isinstance(got, Path) else f"{name}: skipped: {got}")
    return 0 if any(isinstance(g, Path) for g in done.values()) else 1
