"""The two comparison suites, ``run`` (in-process) and ``serve`` (HTTP); what each runs
and writes: ``benchmarks/README.md``."""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import over_http as http
from benchmarks import report, workloads
from benchmarks.in_process import MMServeRunner, Run, TransformersRunner, policy_supported
from benchmarks.in_process import model_dir as default_model_dir

POLICIES = ("lpm", "dfs-weight", "fcfs", "random")
MAIN_POLICY = "lpm"
SWEEP_WORKLOADS = ("many_questions", "multi_turn")
SERVERS = ("mmserve", "mmserve-off", "llamacpp")
#: mmserve (cache on) should reach this fraction of the workload's cost bound.
TARGET_WORKLOAD, TARGET_FRACTION = "many_questions", 0.95


def _log(t0: float) -> Any:
    return lambda msg: print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)


def _mismatches(r: Run, ref: Run) -> int:
    return sum(r.outputs.get(i) != o for i, o in ref.outputs.items())


def run_workload(
    wl: workloads.Workload,
    mm: MMServeRunner,
    hf: TransformersRunner | None,
    policies: list[str],
    scale: dict,
    log: Any,
    closed: bool | None,
) -> tuple[dict, list[Run]]:
    """Every system on ``wl``; the workload's JSON dict and the runs."""
    ids = mm.prompt_ids(wl)
    prompts = {**workloads.optimal_hit_rate(ids), "requests": wl.num_requests}
    prompts["working_set_tokens"] = prompts["distinct_tokens"] + wl.num_requests * wl.max_tokens
    prompts["one_request_tokens"] = max(map(len, ids)) + wl.max_tokens
    runs: list[Run] = []

    def done(r: Run) -> Run:
        s = r.summary()
        log(
            f"  {wl.name:15s} {r.system:26s} {r.wall_s:7.2f} s  "
            f"{s['requests_per_s']:6.3g} req/s  hit {s['cache_hit_rate']:.3f}"
        )
        return r

    if hf is not None:
        eng = mm.engine()
        reqs = mm.requests(eng, wl)
        imgs = {n: mm.decoded[b].image for n, b in wl.images.items()}
        render = eng.processor.prompts.render_chat
        runs.append(
            done(hf.run(wl, render, imgs, [len(r.input_ids) for r in reqs], scale["baseline_max"]))
        )
    on = f"mmserve-{MAIN_POLICY}"
    pairs_of = [("mmserve-off", False)] + ([(on, True)] if MAIN_POLICY in policies else [])
    best: dict[str, Run] = {}
    pairs = []
    repeats = scale["repeats"] if wl.name == "no_sharing" else 1
    for rep in range(repeats):  # (b) and (c, main policy) back to back, order alternating
        got = {}
        for label, radix in pairs_of if rep % 2 == 0 else pairs_of[::-1]:
            r = got[label] = done(mm.run(wl, label, radix_cache=radix, closed_loop=closed))
            if label not in best or r.wall_s < best[label].wall_s:
                best[label] = r
        pairs += [(got["mmserve-off"], got[on])] if on in got else []
    for r in best.values():
        r.repeats = repeats
    for p in policies:
        label = f"mmserve-{p}"
        if label not in best:
            best[label] = done(mm.run(wl, label, policy=p, closed_loop=closed))
    runs += [best["mmserve-off"]] + [best[f"mmserve-{p}"] for p in policies]
    if wl.name == "multi_turn":
        pool = max(prompts["working_set_tokens"] // 2, prompts["one_request_tokens"])
        for p in policies:
            r = mm.run(
                wl, f"mmserve-{p}-halfpool", policy=p, closed_loop=closed, max_total_tokens=pool
            )
            r.notes.append(f"KV pool {pool} tokens = half the working set")
            runs.append(done(r))
    off, ref = best["mmserve-off"], next((r for r in runs if r.kind == "transformers"), None)
    comparisons = {}
    for r in runs:
        c = comparisons[r.system] = {}
        if r.kind == "mmserve":
            c["mismatches_vs_off"] = _mismatches(r, off)
        if ref is not None and r is not ref:
            same = len(ref.outputs) - _mismatches(r, ref)
            c["agree_with_transformers"] = f"{same}/{len(ref.outputs)}"
    res = {
        "workload": wl.name,
        "description": wl.description,
        "params": wl.params,
        "notes": wl.notes,
        "prompts": prompts,
        "systems": [r.summary() for r in runs],
        "comparisons": comparisons,
    }
    if repeats > 1 and pairs:
        res["paired_on_off"] = {  # on req/s over off req/s, per pair
            "wall_ratios": [off.wall_s / on.wall_s for off, on in pairs],
            "cpu_ratios": [off.cpu_s / on.cpu_s for off, on in pairs],
        }
    return res, runs


def pool_sweep(
    wl: workloads.Workload,
    mm: MMServeRunner,
    off: Run,
    prompts: dict,
    points: int,
    log: Any,
    done: dict[int, Run],
    closed: bool | None,
) -> dict:
    """``MAIN_POLICY`` at ``points`` pool sizes, geometric from the working set down to one
    request, plus the pools of ``done`` (runs reused; an interior point within 5 % of one
    of them is dropped)."""
    hi, lo = prompts["working_set_tokens"], prompts["one_request_tokens"]
    sizes = {round(hi * (lo / hi) ** (i / max(points - 1, 1))) for i in range(points)}
    sizes = {x for x in sizes if x in (hi, lo) or all(abs(x - d) > 0.05 * x for d in done)}
    out = []
    for pool in sorted(sizes | set(done), reverse=True):
        r = done.get(pool) or mm.run(
            wl, f"mmserve-{MAIN_POLICY}", max_total_tokens=pool, closed_loop=closed
        )
        s = {**r.summary(), "output_mismatches": _mismatches(r, off)}
        log(
            f"  {wl.name:15s} sweep pool {pool:6d}  hit {s['cache_hit_rate']:.3f}  "
            f"mismatches {s['output_mismatches']}  leak_free {r.leak_free}"
        )
        out.append(s)
    return {
        "workload": wl.name,
        "policy": MAIN_POLICY,
        "working_set_tokens": hi,
        "one_request_tokens": lo,
        "optimal_hit_rate": prompts["optimal_hit_rate"],
        "points": out,
    }


def engine_suite(args: argparse.Namespace, model_dir: str) -> int:
    """``python -m benchmarks run``: see the module docstring; returns the exit code."""
    t0, load0, log = time.perf_counter(), report.loadavg(), _log(time.perf_counter())
    scale = dict(workloads.SCALES["engine"][args.scale])
    if args.baseline_max >= 0:
        scale["baseline_max"] = args.baseline_max or None
    names = [w for w in args.workloads.split(",") if w] or list(workloads.ENGINE_WORKLOADS)
    if bad := [w for w in names if w not in workloads.ENGINE_WORKLOADS]:
        print(f"unknown workload {bad[0]!r}", file=sys.stderr)
        return 2
    from mmserve.model.loader import load_model

    loaded = load_model(model_dir)
    mm = MMServeRunner(loaded, model_dir)
    policies, skipped = [], []
    for p in [p for p in args.policies.split(",") if p]:
        if (err := policy_supported(p)) is None:
            policies.append(p)
        else:
            skipped.append(f"policy {p!r} skipped: EngineConfig rejects it ({err})")
            log(skipped[-1])
    hf = None
    if not args.no_baseline:
        dtype = loaded.decoder.embed_tokens.weight.dtype
        hf = TransformersRunner(model_dir, loaded.never_sample_ids, dtype)
    warm = workloads.many_questions(1, 1, 2, seed=12345)
    mm.run(warm, "warm-up", check_leaks=False)
    if hf is not None:
        run_workload(warm, mm, hf, [], {"baseline_max": 1, "repeats": 1}, lambda _: None, None)
    closed = False if args.lockstep else None
    results, sweeps = {}, {}
    for name in names:
        wl = workloads.build(name, scale, args.seed)
        log(f"{name}: {wl.num_requests} requests")
        res, runs = run_workload(wl, mm, hf, policies, scale, log, closed)
        res["arrival"] = "closed-loop" if wl.sessions and closed is None else "rounds"
        res["skipped"] = skipped
        results[name] = res
        report.write_json(args.out / f"{name}.json", res)
        if name in SWEEP_WORKLOADS and not args.no_sweep and MAIN_POLICY in policies:
            off = next(r for r in runs if r.system == "mmserve-off")
            half = {r.pool_tokens: r for r in runs if r.system == f"mmserve-{MAIN_POLICY}-halfpool"}
            sweeps[name] = pool_sweep(
                wl, mm, off, res["prompts"], scale["sweep_points"], log, half, closed
            )
            report.write_json(args.out / "pool_sweep.json", sweeps)
    targets = report.engine_targets(results, sweeps, MAIN_POLICY)
    meta = {
        "model": Path(model_dir).name,
        "model_dir": model_dir,
        "scale": args.scale,
        "threads": torch.get_num_threads(),
        "seed": args.seed,
        "policies": policies,
        "loadavg_start": load0,
        "loadavg_end": report.loadavg(),
        "total_seconds": time.perf_counter() - t0,
        "torch": torch.__version__,
    }
    report.write_json(args.out / "targets.json", {"meta": meta, "targets": targets})
    text = report.engine_summary(results, sweeps, targets, meta)
    (args.out / "summary.md").write_text(text, encoding="utf-8")
    print(text)
    log(f"done; results in {args.out}")
    return 0


# ---- serve ---------------------------------------------------------------------------


def rate_label(rate: float) -> str:
    """``"burst"`` for inf, else the rate as text."""
    return "burst" if math.isinf(rate) else f"{rate:g}"


def warm_up(url: str) -> None:
    """Two short requests (text and a small image) so no timed run pays first calls.

    Raises:
        RuntimeError: a warm-up request failed.
    """
    wl = workloads.no_sharing(2, 2, seed=4321, image_size=64)
    results, _ = http.run_load(url, http.request_bodies(wl, http.served_model(url)), [0.0, 0.0])
    if bad := [r.error for r in results if not r.ok]:
        raise RuntimeError(f"warm-up failed at {url}: {bad[0]}")


def one_run(
    label: str,
    url: str,
    wl: workloads.Workload,
    rate: float,
    args: Any,
    log: Any,
    pid: int | None = None,
    flush: bool = False,
) -> dict:
    """``wl`` at ``rate`` on a running server; the summary plus its CPU seconds."""
    if flush:
        http.flush(url)
    bodies = http.request_bodies(wl, http.served_model(url))
    arrivals = http.arrival_times(len(bodies), rate, args.seed)
    c0 = http.cpu_seconds(pid)
    results, wall = http.run_load(url, bodies, arrivals)
    c1 = http.cpu_seconds(pid)
    s = http.summarize(results, wl.max_tokens, http.SLO(args.slo_ttft, args.slo_tpot), wall)
    s.update(offered_rate=rate, server_cpu_s=c1 - c0 if c0 is not None and c1 else None)
    s["answers"] = [r.text for r in results]
    log(
        f"  {label:12s} {wl.name:15s} {rate_label(rate):>5s}: {s['duration_s']:6.2f} s  "
        f"{s['request_throughput'] or 0:6.3g} req/s  TTFT p50 {s['ttft_s']['p50'] or 0:.3f} s"
        f"  tokens ok {s['token_counts_ok']}" + (f"  errors {s['errors']}" if s["errors"] else "")
    )
    return s


def http_suite(args: argparse.Namespace, model_dir: str | None) -> int:  # noqa: C901 - steps in order
    """``python -m benchmarks serve``: see the module docstring; returns the exit code."""
    from benchmarks.cost_bound import CostModel, share_costs
    from benchmarks.llamacpp import agreement, find_setup, llama_server
    from mmserve.model.loader import load_model

    t0, log = time.perf_counter(), _log(time.perf_counter())
    scale = workloads.SCALES["http"][args.scale]
    rates = [float(x) for x in args.rates.split(",") if x] if args.rates else scale["rates"]
    names = [w for w in args.workloads.split(",") if w] or list(workloads.HTTP_WORKLOADS)
    servers = [] if args.url else [s for s in args.servers.split(",") if s]
    if bad := [w for w in names if w not in workloads.HTTP_WORKLOADS] + [
        s for s in servers if s not in SERVERS
    ]:
        print(f"unknown workload or server {bad[0]!r}", file=sys.stderr)
        return 2
    notes: list[str] = []
    setup, why = (
        (None, "--no-llamacpp given") if args.no_llamacpp else find_setup(args.llamacpp_dir)
    )
    if "llamacpp" in servers and setup is None:
        servers.remove("llamacpp")
        notes.append(f"llama.cpp skipped: {why}")
    if model_dir is None:  # the llama.cpp setup's checkpoint, or the default one
        size = args.size or ("tiny" if args.scale == "ci" else "small")
        model_dir = str(setup.hf_dir) if setup else default_model_dir(size)
    same_weights = setup is not None and Path(model_dir) == setup.hf_dir
    log(f"model {model_dir}; servers {servers or args.url}; rates {[rate_label(r) for r in rates]}")
    loaded = load_model(model_dir)
    # servers in the in-process model's dtype (fp32): the bound, the agreement engine and
    # the overhead's in-process run use it, and `serve`'s default (auto) may be bf16
    dtype_flag = ["--dtype", str(loaded.decoder.embed_tokens.weight.dtype).removeprefix("torch.")]
    wls = [workloads.build(n, scale, args.seed) for n in names]
    res: dict[str, Any] = {
        "meta": {
            "model_dir": model_dir,
            "model": Path(model_dir).name,
            "scale": args.scale,
            "threads": args.threads,
            "rates": [rate_label(r) for r in rates],
            "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
            "seed": args.seed,
            "loadavg_start": report.loadavg(),
            "cpus": os.cpu_count(),
            "llamacpp": setup.info if setup else None,
        },
        "notes": notes,
        "workloads": {
            wl.name: {
                "description": wl.description,
                "params": wl.params,
                "requests": wl.num_requests,
                "max_tokens": wl.max_tokens,
                "runs": {},
            }
            for wl in wls
        },
    }
    if not args.no_bound and (servers or args.bound):
        cm = CostModel(MMServeRunner(loaded, model_dir), reps=2 if args.scale != "full" else 3)
        bounds = [cm.bound(wl) for wl in wls]
        share_costs(bounds)
        for wl, b in zip(wls, bounds, strict=True):
            res["workloads"][wl.name]["bound"] = b
            log(
                f"bound {wl.name:15s} {b['bound_s']:6.2f} s (prefill {b['prefill_s']:.2f} + "
                f"tower {b['tower_s']:.2f} + decode {b['decode_s']:.2f})"
            )
    logs = Path(tempfile.mkdtemp(prefix="mmserve-serve-"))
    llama = lambda name: llama_server(setup, args.threads, args.llamacpp_slots, logs / name)  # noqa: E731
    for label in servers:
        runs: dict[str, dict] = {}
        if label == "llamacpp":
            for wl in wls:
                for rate in rates:  # a fresh server per run: its prompt cache starts cold
                    with llama("llamacpp.log") as (url, proc):
                        warm_up(url)
                        runs.setdefault(wl.name, {})[rate_label(rate)] = one_run(
                            label, url, wl, rate, args, log, proc.pid
                        )
        else:
            flags = [*http.MMSERVE_SYSTEMS[label], *dtype_flag]
            with http.mmserve_server(model_dir, flags, args.threads, logs / f"{label}.log") as (
                url,
                proc,
            ):
                warm_up(url)
                if label == "mmserve" and same_weights and not args.no_agreement:
                    from mmserve.config import EngineConfig
                    from mmserve.engine.engine import Engine

                    eng = Engine(EngineConfig(model_path=model_dir), model=loaded)
                    with llama("llamacpp-agreement.log") as (ll_url, _):
                        ag = res["agreement"] = agreement(
                            url, ll_url, eng, list(loaded.never_sample_ids)
                        )
                    log(
                        f"agreement: text {ag['text_agree']}/{ag['text_total']}, image "
                        f"{ag['image_agree']}/{ag['image_total']}; passed {ag['passed']}"
                    )
                for wl in wls:
                    for rate in rates:
                        runs.setdefault(wl.name, {})[rate_label(rate)] = one_run(
                            label, url, wl, rate, args, log, proc.pid, flush=True
                        )
                if label == "mmserve" and not args.no_overhead:
                    res["overhead"] = overhead(
                        url, proc.pid, runs, wls, loaded, model_dir, args, log
                    )
        for name, by_rate in runs.items():
            res["workloads"][name]["runs"][label] = by_rate
    for spec in args.url:
        label, _, url = spec.rpartition("=") if "=" in spec else (spec, "", spec)
        for wl in wls:
            res["workloads"][wl.name]["runs"][label] = {
                rate_label(r): one_run(label, url.rstrip("/"), wl, r, args, log) for r in rates
            }
        notes.append(f"{label} ({url}): external server, caches not flushed between runs")
    if "overhead" in res:
        ov = res["overhead"]
        ov["profile"] = profile(model_dir, wls, ov, args, logs, dtype_flag)
    res["meta"].update(loadavg_end=report.loadavg(), total_seconds=time.perf_counter() - t0)
    res["targets"] = report.http_targets(res, TARGET_WORKLOAD, TARGET_FRACTION, 8)
    report.write_json(args.out / "serve.json", res)
    text = report.http_summary(res)
    (args.out / "serve_summary.md").write_text(text, encoding="utf-8")
    print(text)
    log(f"done; results in {args.out}")
    return 0


def overhead(
    url: str,
    pid: int,
    runs: dict,
    wls: list,
    loaded: Any,
    model_dir: str,
    args: Any,
    log: Any,
    pairs: int = 3,
) -> dict:
    """The target workload at mmserve's peak-throughput rate through HTTP (flushed) and
    through an in-process engine at the same arrivals, ``pairs`` times; medians."""
    wl = next((w for w in wls if w.name == TARGET_WORKLOAD), wls[0])
    peak = max(runs[wl.name], key=lambda k: runs[wl.name][k]["request_throughput"] or 0)
    rate = runs[wl.name][peak]["offered_rate"]
    arrivals = http.arrival_times(wl.num_requests, rate, args.seed)
    mm = MMServeRunner(loaded, model_dir)
    got = [
        (
            one_run("mmserve", url, wl, rate, args, log, pid, flush=True),
            mm.run(wl, "in-process", arrivals=arrivals).summary(),
        )
        for _ in range(pairs)
    ]
    med = lambda xs: statistics.median(x for x in xs if x is not None)  # noqa: E731
    h_wall, h_cpu = (
        med(h["duration_s"] for h, _ in got),
        med(h["server_cpu_s"] or 0 for h, _ in got),
    )
    i_wall, i_cpu = med(i["wall_s"] for _, i in got), med(i["cpu_s"] for _, i in got)
    mid = sorted((i for _, i in got), key=lambda i: i["wall_s"])[pairs // 2]
    ov = {
        "workload": wl.name,
        "rate": peak,
        "offered_rate": rate,
        "pairs": pairs,
        "in_process": {**mid, "wall_s": i_wall, "cpu_s": i_cpu},
        "http": {"duration_s": h_wall, "server_cpu_s": h_cpu},
        "http_ttft_p50_s": med(h["ttft_s"]["p50"] for h, _ in got),
        "wall_overhead": h_wall / i_wall - 1,
        "cpu_overhead": h_cpu / i_cpu - 1 if h_cpu else None,
    }
    log(
        f"overhead {wl.name} at {peak}: HTTP {h_wall:.2f} s vs in-process {i_wall:.2f} s "
        f"({ov['wall_overhead']:+.1%})"
    )
    return ov


def profile(
    model_dir: str, wls: list, ov: dict, args: Any, logs: Path, flags: list[str]
) -> dict | None:
    """The overhead run once more on a server under cProfile (:mod:`benchmarks.profiled_server`)."""
    from benchmarks.profiled_server import breakdown

    wl = next(w for w in wls if w.name == ov["workload"])
    path = logs / "profile.pkl"
    with http.mmserve_server(
        model_dir,
        flags,
        args.threads,
        logs / "profiled.log",
        launcher=["-m", "benchmarks.profiled_server"],
        env={"MMSERVE_PROFILE_OUT": str(path)},
    ) as (url, proc):
        warm_up(url)
        http.flush(url)
        bodies = http.request_bodies(wl, http.served_model(url))
        proc.send_signal(signal.SIGUSR1)  # profile the run only
        time.sleep(0.2)
        http.run_load(url, bodies, http.arrival_times(len(bodies), ov["offered_rate"], args.seed))
        proc.send_signal(signal.SIGUSR2)
        for _ in range(100):  # written from the server's main thread
            if path.is_file() and path.stat().st_size:
                break
            time.sleep(0.1)
    return breakdown(path) if path.is_file() else None
