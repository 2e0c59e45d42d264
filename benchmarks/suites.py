"""The two comparison suites, ``run`` (in-process) and ``serve`` (HTTP); what each runs and
writes: ``benchmarks/README.md``."""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from benchmarks import over_http as http
from benchmarks import report, workloads
from benchmarks.in_process import MMServeRunner, Run, TransformersRunner
from benchmarks.in_process import model_dir as default_model_dir
from mmserve.config import EngineConfig

POLICIES = ("lpm", "dfs-weight", "fcfs", "random")
MAIN_POLICY = "lpm"
SWEEP_WORKLOADS = ("many_questions", "multi_turn")
SERVERS = ("mmserve", "mmserve-off", "llamacpp")
#: mmserve (cache on) should reach this fraction of the workload's cost bound.
TARGET_WORKLOAD, TARGET_FRACTION = "many_questions", 0.95
#: Goodput's objective: TTFT and TPOT at most these seconds.
SLO = (5.0, 0.5)


def _log(t0: float) -> Any:
    return lambda msg: print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)


def _mismatches(r: Run, ref: Run) -> int:
    return sum(r.outputs.get(i) != o for i, o in ref.outputs.items())


def _names(given: str, known: tuple[str, ...]) -> list[str]:
    names = [w for w in given.split(",") if w] or list(known)
    if bad := [w for w in names if w not in known]:
        raise SystemExit(f"unknown name {bad[0]!r}; known: {', '.join(known)}")
    return names


def run_workload(
    wl: workloads.Workload,
    mm: MMServeRunner,
    hf: TransformersRunner | None,
    policies: list[str],
    scale: dict,
    log: Any,
    closed: bool | None,
) -> tuple[dict, list[Run]]:
    """Every system on ``wl``: transformers, cache off, each policy (with ``repeats`` on/off
    pairs in alternating order on no_sharing), each policy at half the working set on
    multi_turn. Returns the workload's JSON dict and the runs."""
    ids = mm.prompt_ids(wl)
    prompts = {**workloads.optimal_hit_rate(ids), "requests": wl.num_requests}
    prompts["working_set_tokens"] = prompts["distinct_tokens"] + wl.num_requests * wl.max_tokens
    prompts["one_request_tokens"] = max(map(len, ids)) + wl.max_tokens

    def done(r: Run) -> Run:
        s = r.summary()
        log(
            f"  {wl.name:15s} {r.system:26s} {r.wall_s:7.2f} s  "
            f"{s['requests_per_s']:6.3g} req/s  hit {s['cache_hit_rate']:.3f}"
        )
        return r

    runs: list[Run] = []
    if hf is not None:
        eng = mm.engine()
        lens = [len(r.input_ids) for r in mm.requests(eng, wl)]
        imgs = {n: mm.decoded[b].image for n, b in wl.images.items()}
        render = eng.processor.prompts.render_chat
        runs.append(done(hf.run(wl, render, imgs, lens, scale["baseline_max"])))
    on = f"mmserve-{MAIN_POLICY}"
    pair = [("mmserve-off", False)] + ([(on, True)] if MAIN_POLICY in policies else [])
    best: dict[str, Run] = {}
    pairs = []
    for rep in range(scale["repeats"] if wl.name == "no_sharing" else 1):
        got = {}
        for label, radix in pair if rep % 2 == 0 else pair[::-1]:
            r = got[label] = done(mm.run(wl, label, radix_cache=radix, closed_loop=closed))
            if label not in best or r.wall_s < best[label].wall_s:
                best[label] = r
        pairs += [(got["mmserve-off"], got[on])] if on in got else []
    for p in policies:
        if f"mmserve-{p}" not in best:
            best[f"mmserve-{p}"] = done(mm.run(wl, f"mmserve-{p}", policy=p, closed_loop=closed))
    runs += [best["mmserve-off"]] + [best[f"mmserve-{p}"] for p in policies]
    if wl.name == "multi_turn":
        pool = max(prompts["working_set_tokens"] // 2, prompts["one_request_tokens"])
        for p in policies:
            r = mm.run(
                wl, f"mmserve-{p}-halfpool", policy=p, closed_loop=closed, max_total_tokens=pool
            )
            r.notes.append(f"KV pool {pool} tokens = half the working set")
            runs.append(done(r))
    off, ref = best["mmserve-off"], runs[0] if hf is not None else None
    comparisons = {}
    for r in runs:
        c = comparisons[r.system] = {}
        if r.kind == "mmserve":
            c["mismatches_vs_off"] = _mismatches(r, off)
        if ref is not None and r is not ref:
            same = len(ref.outputs) - _mismatches(r, ref)
            c["agree_with_transformers"] = f"{same}/{len(ref.outputs)}"
    res = {"workload": wl.name, "description": wl.description, "params": wl.params}
    res.update(notes=[], prompts=prompts, comparisons=comparisons)
    res["systems"] = [r.summary() for r in runs]
    if len(pairs) > 1:  # on req/s over off req/s, per pair
        res["paired_on_off"] = {
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
        label = f"mmserve-{MAIN_POLICY}"
        r = done.get(pool) or mm.run(wl, label, max_total_tokens=pool, closed_loop=closed)
        out.append(s := {**r.summary(), "output_mismatches": _mismatches(r, off)})
        log(
            f"  {wl.name:15s} sweep pool {pool:6d}  hit {s['cache_hit_rate']:.3f}  "
            f"mismatches {s['output_mismatches']}  leak_free {r.leak_free}"
        )
    sweep = {"workload": wl.name, "policy": MAIN_POLICY, "working_set_tokens": hi}
    sweep.update(one_request_tokens=lo, optimal_hit_rate=prompts["optimal_hit_rate"])
    return {**sweep, "points": out}


def engine_suite(args: argparse.Namespace, model_dir: str) -> int:
    """``python -m benchmarks run``: transformers, mmserve with the caches off and on per
    policy, and the KV-pool sweep, per workload; returns the exit code."""
    t0, load0, log = time.perf_counter(), report.loadavg(), _log(time.perf_counter())
    scale = dict(workloads.SCALES["engine"][args.scale])
    if args.baseline_max >= 0:
        scale["baseline_max"] = args.baseline_max or None
    names = _names(args.workloads, workloads.ENGINE_WORKLOADS)
    mm = MMServeRunner.load(model_dir)
    policies, skipped = [], []
    for p in [p for p in args.policies.split(",") if p]:
        try:
            EngineConfig(policy=p).validate()
            policies.append(p)
        except ValueError as e:
            skipped.append(f"policy {p!r} skipped: EngineConfig rejects it ({e})")
            log(skipped[-1])
    hf = None
    if not args.no_baseline:
        hf = TransformersRunner(model_dir, mm.model.never_sample_ids, torch.float32)
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
    meta = {"model": Path(model_dir).name, "model_dir": model_dir, "scale": args.scale}
    meta.update(threads=torch.get_num_threads(), seed=args.seed, policies=policies)
    meta.update(loadavg_start=load0, loadavg_end=report.loadavg(), torch=torch.__version__)
    meta["total_seconds"] = time.perf_counter() - t0
    text = report.engine_summary(results, sweeps, targets, meta)
    return report.emit(args.out, "summary", {"meta": meta, "targets": targets}, text)


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
    label: str, url: str, wl: workloads.Workload, rate: float, seed: int, log: Any, pid: Any = None
) -> dict:
    """``wl`` at ``rate`` on a running server (mmserve's caches flushed first when ``pid``
    is given); the summary plus the server's CPU seconds and the answers."""
    if pid is not None and label != "llamacpp":
        http.flush(url)
    bodies = http.request_bodies(wl, http.served_model(url))
    c0 = http.cpu_seconds(pid)
    results, wall = http.run_load(url, bodies, http.arrival_times(len(bodies), rate, seed))
    c1 = http.cpu_seconds(pid)
    s = http.summarize(results, wl.max_tokens, SLO, wall)
    s.update(offered_rate=rate, server_cpu_s=c1 - c0 if c0 is not None and c1 else None)
    s["answers"] = [r.text for r in results]
    log(
        f"  {label:12s} {wl.name:15s} {rate_label(rate):>5s}: {s['duration_s']:6.2f} s  "
        f"{s['request_throughput'] or 0:6.3g} req/s  TTFT p50 {s['ttft_s']['p50'] or 0:.3f} s"
        f"  tokens ok {s['token_counts_ok']}" + (f"  errors {s['errors']}" if s["errors"] else "")
    )
    return s


def http_suite(args: argparse.Namespace, model_dir: str | None) -> int:
    """``python -m benchmarks serve``: every server at every workload and rate, against
    the cost bound, with llama.cpp's agreement and mmserve's HTTP overhead; returns the exit
    code."""
    from benchmarks.cost_bound import CostModel, share_costs
    from benchmarks.llamacpp import agreement, find_setup, llama_server

    t0, log = time.perf_counter(), _log(time.perf_counter())
    scale = workloads.SCALES["http"][args.scale]
    rates = [float(x) for x in args.rates.split(",") if x] if args.rates else scale["rates"]
    wls = [
        workloads.build(n, scale, args.seed)
        for n in _names(args.workloads, workloads.HTTP_WORKLOADS)
    ]
    servers = [] if args.url else _names(args.servers, SERVERS)
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
    log(f"model {model_dir}; servers {servers or args.url}; rates {[rate_label(r) for r in rates]}")
    mm = MMServeRunner.load(model_dir)
    meta = {"model_dir": model_dir, "model": Path(model_dir).name, "scale": args.scale}
    meta.update(threads=args.threads, rates=[rate_label(r) for r in rates], seed=args.seed)
    meta.update(slo={"ttft_s": SLO[0], "tpot_s": SLO[1]}, loadavg_start=report.loadavg())
    meta.update(cpus=os.cpu_count(), llamacpp=setup.info if setup else None)
    res: dict[str, Any] = {"meta": meta, "notes": notes, "workloads": {}}
    for wl in wls:
        w = res["workloads"][wl.name] = {"description": wl.description, "params": wl.params}
        w.update(requests=wl.num_requests, max_tokens=wl.max_tokens, runs={})
    if servers and not args.no_bound:
        cm = CostModel(mm, reps=2 if args.scale != "full" else 3)
        bounds = [cm.bound(wl) for wl in wls]
        share_costs(bounds)
        for wl, b in zip(wls, bounds, strict=True):
            res["workloads"][wl.name]["bound"] = b
            log(
                f"bound {wl.name:15s} {b['bound_s']:6.2f} s (prefill {b['prefill_s']:.2f} + "
                f"tower {b['tower_s']:.2f} + decode {b['decode_s']:.2f})"
            )
    logs = Path(tempfile.mkdtemp(prefix="mmserve-serve-"))
    llama = lambda name: llama_server(setup, args.threads, 4, logs / name)  # noqa: E731
    # servers in the in-process model's dtype (fp32), as the bound, the agreement engine and
    # the overhead's in-process run: `serve`'s default (auto) may be bf16
    dtype = ["--dtype", "float32"]
    for label in servers:
        # one mmserve server, flushed before each run; llama.cpp fresh per run (cold cache)
        fresh = label == "llamacpp"
        flags = [*http.MMSERVE_SYSTEMS.get(label, []), *dtype]
        log_path = logs / f"{label}.log"
        server = http.mmserve_server(model_dir, flags, args.threads, log_path)
        with nullcontext((None, None)) if fresh else server as (url, proc):
            if not fresh:
                warm_up(url)
            if label == "mmserve" and setup and Path(model_dir) == setup.hf_dir:
                with llama("llamacpp-agreement.log") as (ll_url, _):
                    eng = mm.engine()
                    ag = res["agreement"] = agreement(
                        url, ll_url, eng, list(mm.model.never_sample_ids)
                    )
                log(
                    f"agreement: text {ag['text_agree']}/{ag['text_total']}, image "
                    f"{ag['image_agree']}/{ag['image_total']}; passed {ag['passed']}"
                )
            for wl in wls:
                runs = res["workloads"][wl.name]["runs"].setdefault(label, {})
                for rate in rates:
                    with llama("llamacpp.log") if fresh else nullcontext((url, proc)) as (u, p):
                        if fresh:
                            warm_up(u)
                        runs[rate_label(rate)] = one_run(label, u, wl, rate, args.seed, log, p.pid)
            if label == "mmserve" and not args.no_overhead:
                res["overhead"] = overhead(url, proc.pid, res, wls, mm, args.seed, log)
    for spec in args.url:
        label, _, url = spec.rpartition("=") if "=" in spec else (spec, "", spec)
        for wl in wls:
            res["workloads"][wl.name]["runs"][label] = {
                rate_label(r): one_run(label, url.rstrip("/"), wl, r, args.seed, log) for r in rates
            }
        notes.append(f"{label} ({url}): external server, caches not flushed between runs")
    if ov := res.get("overhead"):
        ov["profile"] = profile(model_dir, wls, ov, args, logs, dtype)
    meta.update(loadavg_end=report.loadavg(), total_seconds=time.perf_counter() - t0)
    res["targets"] = report.http_targets(res, TARGET_WORKLOAD, TARGET_FRACTION, 8)
    return report.emit(args.out, "serve", res, report.http_summary(res))


def overhead(
    url: str, pid: int, res: dict, wls: list, mm: MMServeRunner, seed: int, log: Any, pairs: int = 3
) -> dict:
    """The target workload at mmserve's peak-throughput rate through HTTP (flushed) and
    through an in-process engine at the same arrivals, ``pairs`` times; medians."""
    wl = next((w for w in wls if w.name == TARGET_WORKLOAD), wls[0])
    runs = res["workloads"][wl.name]["runs"]["mmserve"]
    peak = max(runs, key=lambda k: runs[k]["request_throughput"] or 0)
    rate = runs[peak]["offered_rate"]
    arrivals = http.arrival_times(wl.num_requests, rate, seed)
    got = [
        (
            one_run("mmserve", url, wl, rate, seed, log, pid),
            mm.run(wl, "in-process", arrivals=arrivals).summary(),
        )
        for _ in range(pairs)
    ]
    med = lambda f: statistics.median(f(*p) or 0 for p in got)  # noqa: E731
    h = {"wall_s": med(lambda x, _: x["duration_s"]), "cpu_s": med(lambda x, _: x["server_cpu_s"])}
    h["ttft_p50_s"] = med(lambda x, _: x["ttft_s"]["p50"])
    ip = sorted((i for _, i in got), key=lambda i: i["wall_s"])[pairs // 2]  # the median run
    ip = {**ip, "wall_s": med(lambda _, y: y["wall_s"]), "cpu_s": med(lambda _, y: y["cpu_s"])}
    ov = {"workload": wl.name, "rate": peak, "offered_rate": rate, "pairs": pairs}
    ov.update(in_process=ip, http=h, wall_overhead=h["wall_s"] / ip["wall_s"] - 1)
    ov["cpu_overhead"] = h["cpu_s"] / ip["cpu_s"] - 1 if h["cpu_s"] else None
    log(
        f"overhead {wl.name} at {peak}: HTTP {h['wall_s']:.2f} s vs in-process "
        f"{ip['wall_s']:.2f} s ({ov['wall_overhead']:+.1%})"
    )
    return ov


def profile(
    model_dir: str, wls: list, ov: dict, args: Any, logs: Path, flags: list[str]
) -> dict | None:
    """The overhead run once more on a server under cProfile (:mod:`benchmarks.profiled_server`)."""
    from benchmarks.profiled_server import breakdown

    wl = next(w for w in wls if w.name == ov["workload"])
    path = logs / "profile.pkl"
    launcher, env = ["-m", "benchmarks.profiled_server"], {"MMSERVE_PROFILE_OUT": str(path)}
    with http.mmserve_server(
        model_dir, flags, args.threads, logs / "profiled.log", launcher, env
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
