"""HTTP serving benchmark: ``python -m benchmarks.serve [--quick] [--url NAME=URL ...]``.

Measures what users measure: servers through their OpenAI-compatible HTTP API under
open-loop load (:mod:`benchmarks.loadgen`), side by side, against each workload's
cost bound (:mod:`benchmarks.cost_bound`). With no ``--url`` it runs, one after the
other and with the same thread count:

- ``mmserve``: ``mmserve serve`` with its caches on (radix prefix cache, vision cache);
- ``mmserve-off``: ``--disable-radix-cache --vision-cache-bytes 0``;
- ``llamacpp``: llama.cpp's ``llama-server`` on the same weights (prompt cache on), from
  the folder ``scripts/setup_llamacpp.sh`` writes (``.llamacpp``); skipped with a note
  when that folder is absent (as in CI).

Each server gets every workload at every offered rate from a cold cache (mmserve:
``POST /v1/cache/flush`` before each run; llama.cpp: a fresh process per run). Before
any timing mmserve and llama.cpp answer the same greedy chats
(:mod:`benchmarks.agreement`); after the sweep the mmserve run with the highest
throughput is replayed in-process and under a profile (:mod:`benchmarks.http_overhead`).

Writes ``<out>/serve.json``, ``<out>/serve_latency.png`` and ``<out>/serve_summary.md``
(default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks import serve_report, serve_workloads
from benchmarks.llamacpp import LlamaServerConfig, find_setup, llama_server
from benchmarks.loadgen import SLO, arrival_times, request_bodies, run_load, summarize
from benchmarks.servers import MMSERVE_SYSTEMS, cpu_seconds, mmserve_server

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
SERVERS = ("mmserve", "mmserve-off", "llamacpp")
#: The workload whose target is achieved / bound >= this for mmserve (cache on).
TARGET_WORKLOAD, TARGET_FRACTION = "many_questions", 0.95


def rate_label(rate: float) -> str:
    """``"burst"`` for inf, else the rate as text (``"1"``, ``"0.5"``)."""
    return "burst" if math.isinf(rate) else f"{rate:g}"


def _post(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else b""  # flush takes no body
    headers = {"Content-Type": "application/json"} if body is not None else {}
    req = urllib.request.Request(url, data, headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def flush_mmserve(url: str) -> None:
    """Empty mmserve's prefix and vision caches (retries while requests finish).

    Raises:
        RuntimeError: the server refused for 10 s.
    """
    for _ in range(40):
        status, body = _post(f"{url}/v1/cache/flush")
        if status == 200:
            return
        time.sleep(0.25)
    raise RuntimeError(f"cache flush refused: {status} {body[:200]!r}")


def warm_up(url: str, model: str | None, extra: dict | None = None) -> None:
    """Two short requests (text, then a small image) so no timed run pays first calls."""
    from benchmarks import workloads

    wl = workloads.no_sharing(2, 2, seed=4321, image_size=64)
    bodies = request_bodies(wl, model, extra)
    results, _ = run_load(url, bodies, [0.0, 0.0], timeout=300)
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"warm-up failed at {url}: {bad[0]}")


def served_model(url: str) -> str | None:
    """The first model id of ``GET /v1/models``, None if the server does not say."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
            data = json.loads(r.read()).get("data") or []
        return data[0]["id"] if data else None
    except (OSError, ValueError, KeyError):
        return None


def run_sweep(
    label: str,
    url: str,
    wls: list,
    rates: list[float],
    slo: SLO,
    seed: int,
    log: Any,
    pid: int | None = None,
    flush: Any = None,
    extra: dict | None = None,
) -> dict[str, dict[str, dict]]:
    """Every workload at every rate on one running server; ``{workload: {rate: summary}}``."""
    model = served_model(url)
    out: dict[str, dict[str, dict]] = {}
    for wl in wls:
        bodies = request_bodies(wl, model, extra)
        for rate in rates:
            out.setdefault(wl.name, {})[rate_label(rate)] = one_run(
                label, url, wl, bodies, rate, slo, seed, log, pid, flush
            )
    return out


def one_run(
    label: str,
    url: str,
    wl: Any,
    bodies: list[bytes],
    rate: float,
    slo: SLO,
    seed: int,
    log: Any,
    pid: int | None,
    flush: Any,
) -> dict:
    """One workload at one rate; the summary plus the server's CPU seconds."""
    if flush is not None:
        flush()
    arrivals = arrival_times(len(bodies), rate, seed)
    c0 = cpu_seconds(pid) if pid else None
    results, wall = run_load(url, bodies, arrivals)
    c1 = cpu_seconds(pid) if pid else None
    s = summarize(results, wl.max_tokens, slo, wall)
    s["offered_rate"] = rate
    s["server_cpu_s"] = (c1 - c0) if c0 is not None and c1 is not None else None
    s["answers"] = [r.text for r in results]
    log(
        f"  {label:12s} {wl.name:15s} rate {rate_label(rate):>5s}: {s['duration_s']:6.2f} s  "
        f"{s['request_throughput'] or 0:6.3g} req/s  TTFT p50 {s['ttft_s']['p50'] or 0:.3f} s  "
        f"TPOT p50 {s['tpot_s']['p50'] or 0:.3f} s  tokens ok {s['token_counts_ok']}"
        + (f"  errors {s['errors']}" if s["errors"] else "")
    )
    return s


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.serve", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--quick", action="store_true", help="same as --scale quick")
    ap.add_argument("--scale", choices=sorted(serve_workloads.SCALES), default="full")
    ap.add_argument(
        "--url",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="benchmark a running OpenAI-compatible server instead (repeatable); no caches "
        "are flushed and no cost bound is measured unless --bound",
    )
    ap.add_argument("--servers", default=",".join(SERVERS), help="managed servers to run")
    ap.add_argument(
        "--workloads", default=",".join(serve_workloads.WORKLOADS), help="comma-separated"
    )
    ap.add_argument("--rates", help="offered rates in req/s, 'inf' = burst (default: per scale)")
    ap.add_argument("--slo-ttft", type=float, default=5.0, help="SLO on TTFT (s) for goodput")
    ap.add_argument("--slo-tpot", type=float, default=0.5, help="SLO on TPOT (s) for goodput")
    ap.add_argument("--threads", type=int, default=1, help="threads of every server (and here)")
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: see README)")
    ap.add_argument("--size", choices=("tiny", "small"), help="mmserve checkpoint size")
    ap.add_argument("--llamacpp-dir", type=Path, help="setup folder (default .llamacpp)")
    ap.add_argument("--llamacpp-slots", type=int, default=4, help="llama-server -np")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp")
    ap.add_argument("--no-bound", action="store_true", help="skip the cost-bound microbenchmark")
    ap.add_argument("--bound", action="store_true", help="measure the bound with --url too")
    ap.add_argument("--no-overhead", action="store_true", help="skip the HTTP-overhead step")
    ap.add_argument("--no-agreement", action="store_true", help="skip the agreement check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.quick:
        args.scale = "quick"
    return args


def main(argv: list[str] | None = None) -> int:  # noqa: C901 - the run's steps in order
    """Run the benchmark; returns the exit code."""
    args = parse_args(argv)
    t_start = time.perf_counter()
    scale = serve_workloads.SCALES[args.scale]
    rates = [float(x) for x in args.rates.split(",") if x] if args.rates else list(scale["rates"])
    names = [w for w in args.workloads.split(",") if w]
    for w in names:
        if w not in serve_workloads.WORKLOADS:
            print(f"unknown workload {w!r}", file=sys.stderr)
            return 2
    servers = [s for s in args.servers.split(",") if s] if not args.url else []
    for s in servers:
        if s not in SERVERS:
            print(f"unknown server {s!r}; choose from {', '.join(SERVERS)}", file=sys.stderr)
            return 2
    out = args.out
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    import torch

    torch.set_num_threads(args.threads)
    from mmserve.model.loader import load_model
    from mmserve.model.make_checkpoint import ensure_model

    notes: list[str] = []
    setup, why = (
        (None, "--no-llamacpp given") if args.no_llamacpp else find_setup(args.llamacpp_dir)
    )
    if "llamacpp" in servers and setup is None:
        servers.remove("llamacpp")
        notes.append(f"llama.cpp skipped: {why}")
        log(notes[-1])
    if args.model:
        model_dir = str(args.model)
    elif setup is not None:
        model_dir = str(setup.hf_dir)
        notes.append(
            "checkpoint: the llama.cpp setup's LLaVA-1.5 `small` (same weights as `mmserve "
            "make-model --size small`, SentencePiece tokenizer), served by every server"
        )
    else:
        size = args.size or ("tiny" if args.scale == "ci" else "small")
        model_dir = str(ensure_model(size))
    log(
        f"model {model_dir}; servers {servers or [u for u in args.url]}; rates "
        f"{[rate_label(r) for r in rates]}; {args.threads} thread(s) each"
    )
    loaded = load_model(model_dir)
    wls = [serve_workloads.build(n, scale, args.seed) for n in names]
    slo = SLO(args.slo_ttft, args.slo_tpot)
    res: dict[str, Any] = {
        "meta": {
            "model_dir": model_dir,
            "model": (
                f"{Path(model_dir).name} (llama.cpp setup's checkpoint)"
                if setup is not None and Path(model_dir) == setup.hf_dir
                else Path(model_dir).name
            ),
            "scale": args.scale,
            "threads": args.threads,
            "rates": [rate_label(r) for r in rates],
            "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
            "seed": args.seed,
            "loadavg_start": _loadavg(),
            "cpus": os.cpu_count(),
            "llamacpp": (setup.info if setup else None),
            "llamacpp_slots": args.llamacpp_slots,
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

    # ---- 1. cost bound (in-process microbenchmarks of the same model) --------------
    if not args.no_bound and (servers or args.bound):
        from benchmarks.cost_bound import CostModel, share_costs
        from benchmarks.systems import MMServeRunner

        cm = CostModel(loaded, model_dir, reps=2 if args.scale != "full" else 3)
        mm = MMServeRunner(loaded, model_dir)
        for wl in wls:
            res["workloads"][wl.name]["bound"] = cm.bound(wl, mm.prompt_ids(wl))
        share_costs([res["workloads"][wl.name]["bound"] for wl in wls])
        for wl in wls:
            b = res["workloads"][wl.name]["bound"]
            log(
                f"bound {wl.name:15s} {b['bound_s']:6.2f} s (prefill {b['prefill_s']:.2f} "
                f"+ tower {b['tower_s']:.2f} + decode {b['decode_s']:.2f}); distinct tokens "
                f"{b['distinct_prompt_tokens']}/{b['prompt_tokens']}, images "
                f"{b['distinct_images']}/{b['images']}"
            )
        del cm, mm

    # ---- 2. servers -----------------------------------------------------------------
    logs = Path(tempfile.mkdtemp(prefix="mmserve-serve-"))
    llcfg = LlamaServerConfig(threads=args.threads, slots=args.llamacpp_slots)
    for label in servers:
        if label.startswith("mmserve"):
            with ExitStack() as stack:
                url, proc = stack.enter_context(
                    mmserve_server(
                        model_dir, MMSERVE_SYSTEMS[label], args.threads, logs / f"{label}.log"
                    )
                )
                warm_up(url, served_model(url))
                agree = setup is not None and Path(model_dir) == setup.hf_dir
                if label == "mmserve" and agree and not args.no_agreement:
                    res["agreement"] = _agreement(url, setup, llcfg, loaded, logs, log)
                runs = run_sweep(
                    label, url, wls, rates, slo, args.seed, log, proc.pid,
                    flush=lambda u=url: flush_mmserve(u),
                )  # fmt: skip
                if label == "mmserve" and not args.no_overhead:
                    res["overhead"] = _overhead_pairs(
                        url, proc.pid, runs, wls, loaded, model_dir, slo, args, log
                    )
        else:
            assert setup is not None
            runs = {}
            for wl in wls:
                for rate in rates:  # a fresh server per run: its prompt cache starts cold
                    with llama_server(setup, llcfg, logs / "llamacpp.log") as (url, proc):
                        model = served_model(url)
                        warm_up(url, model)
                        bodies = request_bodies(wl, model)
                        runs.setdefault(wl.name, {})[rate_label(rate)] = one_run(
                            label, url, wl, bodies, rate, slo, args.seed, log, proc.pid, None
                        )
        for wl_name, by_rate in runs.items():
            res["workloads"][wl_name]["runs"][label] = by_rate
    for spec in args.url:
        label, _, url = spec.partition("=")
        if not url:
            label, url = url or spec, spec
        runs = run_sweep(label, url.rstrip("/"), wls, rates, slo, args.seed, log)
        for wl_name, by_rate in runs.items():
            res["workloads"][wl_name]["runs"][label] = by_rate
        notes.append(f"{label} ({url}): external server, caches not flushed between runs")

    # ---- 3. HTTP overhead: in-process replay and a profile of the peak run ----------
    if "overhead" in res:
        from benchmarks.http_overhead import breakdown

        ov = res["overhead"]
        wl = next(w for w in wls if w.name == ov["workload"])
        arrivals = arrival_times(wl.num_requests, ov["offered_rate"], args.seed)
        prof = logs / "profile.pkl"
        with mmserve_server(
            model_dir,
            [],
            args.threads,
            logs / "mmserve-profiled.log",
            launcher=[sys.executable, "-m", "benchmarks.profiled_server"],
            env={"MMSERVE_PROFILE_OUT": str(prof)},
        ) as (url, proc):
            model = served_model(url)
            warm_up(url, model)
            flush_mmserve(url)
            bodies = request_bodies(wl, model)
            proc.send_signal(signal.SIGUSR1)  # profile the run only
            time.sleep(0.2)
            results, wall = run_load(url, bodies, arrivals)
            proc.send_signal(signal.SIGUSR2)
            for _ in range(100):  # the dump is written from the server's main thread
                if prof.is_file() and prof.stat().st_size:
                    break
                time.sleep(0.1)
            time.sleep(0.5)
            ov["profiled_run_s"] = wall
        if prof.is_file():
            ov["profile"] = breakdown(prof)
            log(f"profile: largest non-engine item {ov['profile']['largest']}")
        else:
            ov["profile"] = None
            notes.append("HTTP profile: the profiled server wrote no profile")
        res["overhead"] = ov

    # ---- 4. report --------------------------------------------------------------------
    res["meta"]["loadavg_end"] = _loadavg()
    res["meta"]["total_seconds"] = time.perf_counter() - t_start
    res["targets"] = serve_report.targets(res, TARGET_WORKLOAD, TARGET_FRACTION)
    _write_json(out / "serve.json", res)
    plot = serve_report.plot_latency(out / "serve_latency.png", res)
    if plot is None:
        has_runs = any(w["runs"] for w in res["workloads"].values())
        notes.append(
            "no plot: matplotlib is missing (pip install -e '.[bench]')"
            if has_runs
            else "no plot: no server ran"
        )
    text = serve_report.write_summary(out / "serve_summary.md", res, plot)
    print(text)
    log(f"done; results in {out}")
    return 0


def _overhead_pairs(
    url: str,
    pid: int,
    runs: dict[str, dict[str, dict]],
    wls: list,
    loaded: Any,
    model_dir: str,
    slo: SLO,
    args: argparse.Namespace,
    log: Any,
    pairs: int = 3,
) -> dict[str, Any]:
    """HTTP against in-process on the target workload at mmserve's peak-throughput rate:
    ``pairs`` back-to-back pairs (an HTTP run on the running server, cache flushed, then
    the same arrivals through an in-process engine), medians reported."""
    import statistics

    from benchmarks.http_overhead import replay_in_process

    wl = next((w for w in wls if w.name == TARGET_WORKLOAD), wls[0])
    by_rate = runs[wl.name]
    peak = max(by_rate, key=lambda k: by_rate[k]["request_throughput"] or 0)
    rate = by_rate[peak]["offered_rate"]
    arrivals = arrival_times(wl.num_requests, rate, args.seed)
    bodies = request_bodies(wl, served_model(url))
    http, inproc = [], []
    for _ in range(pairs):
        http.append(one_run("mmserve", url, wl, bodies, rate, slo, args.seed, log, pid,
                            lambda: flush_mmserve(url)))  # fmt: skip
        inproc.append(replay_in_process(loaded, model_dir, wl, arrivals))

    def med(xs: list) -> float | None:
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    h_wall, h_cpu = med([h["duration_s"] for h in http]), med([h["server_cpu_s"] for h in http])
    i_wall, i_cpu = med([r["duration_s"] for r in inproc]), med([r["cpu_s"] for r in inproc])
    mid = sorted(inproc, key=lambda r: r["duration_s"])[len(inproc) // 2]
    ov = {
        "workload": wl.name,
        "rate": peak,
        "offered_rate": rate,
        "pairs": pairs,
        "in_process": {**mid, "duration_s": i_wall, "cpu_s": i_cpu},
        "in_process_runs_s": [r["duration_s"] for r in inproc],
        "http": {"duration_s": h_wall, "server_cpu_s": h_cpu},
        "http_runs_s": [h["duration_s"] for h in http],
        "http_ttft_p50_s": med([h["ttft_s"]["p50"] for h in http]),
        "wall_overhead": h_wall / i_wall - 1,
        "cpu_overhead": h_cpu / i_cpu - 1 if h_cpu else None,
    }
    log(
        f"overhead {wl.name} at {peak}, median of {pairs} pairs: HTTP {h_wall:.2f} s vs "
        f"in-process {i_wall:.2f} s ({ov['wall_overhead']:+.1%}); CPU {h_cpu or 0:.2f} vs "
        f"{i_cpu:.2f} s"
    )
    return ov


def _agreement(
    mm_url: str, setup: Any, llcfg: LlamaServerConfig, loaded: Any, logs: Path, log: Any
) -> dict:
    """Start llama.cpp beside the running mmserve and compare greedy answers."""
    from benchmarks.agreement import check
    from mmserve.config import EngineConfig
    from mmserve.engine.engine import Engine

    engine = Engine(EngineConfig(model_path=str(setup.hf_dir)), model=loaded)
    with llama_server(setup, llcfg, logs / "llamacpp-agreement.log") as (ll_url, _):
        got = check(mm_url, ll_url, engine, list(loaded.never_sample_ids))
    log(
        f"agreement: text {got['text_agree']}/{got['text_total']}, image "
        f"{got['image_agree']}/{got['image_total']}; passed {got['passed']}"
    )
    flush_mmserve(mm_url)
    return got


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _write_json(path: Path, obj: Any) -> None:
    def default(x: Any) -> Any:
        return str(x)

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None if math.isnan(x) else "inf"
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x

    path.write_text(json.dumps(clean(obj), indent=2, default=default) + "\n", encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())
