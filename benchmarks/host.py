"""``python -m benchmarks host`` (issue 41): the host path around the forward, on the tiny
model. The same chat requests (``ignore_eos``, greedy) run on the engine alone in this
process and on ``mmserve serve`` over HTTP (streamed and plain), at each concurrency, in
interleaved pairs (engine, streamed, plain; then again), medians reported:

- tokens/s of each, and the ratio server / engine of the same pair;
- the server's CPU microseconds per generated token by process: the server's own
  process ("api") and its child processes ("engine": where the engine core runs once it
  has its own process; 0 while it runs inside the API process), from ``/proc/<pid>/stat``,
  and the load generator's (this process: :mod:`benchmarks.host_client`, aiohttp by
  default), which shares the cores;
- the engine's host microseconds per generated token outside the forward (schedule,
  sample, update, emit: the step's time less the model runner's ``decode`` and
  ``prefill``, both as the engine thread's CPU time, with one torch thread), in
  decode-only steps at each batch.

Writes ``host.json`` in the shape of :data:`benchmarks.plot.HOST_SHAPE` (``python -m
benchmarks plot`` draws ``host.png``). What it measures and the results:
``benchmarks/README.md``, "Host path".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks import over_http as http
from benchmarks.host_client import CLIENTS, send_all
from mmserve.config import EngineConfig
from mmserve.engine.engine import EngineCore
from mmserve.frontend.frontend import FrontEnd
from mmserve.model.loader import load_model
from mmserve.types import EngineRequest, SamplingParams

#: ``--scale`` -> (concurrencies, tokens per answer, pairs).
SCALES: dict[str, tuple[tuple[int, ...], int, int]] = {
    "full": ((64, 128, 256), 128, 3),
    "quick": ((8, 16), 8, 1),
    "ci": ((4,), 4, 1),
}
#: The server's and the in-process engine's settings beside the defaults: room for every
#: request at once (no retraction, no queueing behind ``max_running_requests``).
MAX_RUNNING = 512


def prompts(n: int) -> list[list[dict]]:
    """``n`` short chats, each its own (no two share a prompt, so no answer is a cache
    hit), of about the same length."""
    ask = "Question {}: say something about {}."
    return [[{"role": "user", "content": ask.format(i, i * 7)}] for i in range(n)]


def pool_tokens(concurrency: int, tokens: int) -> int:
    """A KV pool with room for every request's prompt and answer at once."""
    return concurrency * (tokens + 64) + 4096


class EngineAlone:
    """The engine core in this process on one loaded model, with the front end's
    ``make_request`` (templates, tokenizing) done before the clock starts."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.model = load_model(model_dir)
        self.front: FrontEnd | None = None

    def _engine(self, concurrency: int, tokens: int) -> EngineCore:
        cfg = EngineConfig(
            model_path=self.model_dir,
            max_running_requests=MAX_RUNNING,
            max_total_tokens=pool_tokens(concurrency, tokens),
        )
        return EngineCore(cfg, model=self.model)

    def requests(self, eng: EngineCore, concurrency: int, tokens: int) -> list[EngineRequest]:
        """The chat requests of one run, as the front end builds them."""
        if self.front is None:
            self.front = FrontEnd(eng.config, self.model, grammars=eng.grammars)
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        proc = self.front.processor
        return [proc.make_request(messages=m, params=params) for m in prompts(concurrency)]

    def run(self, concurrency: int, tokens: int) -> dict[str, float]:
        """tokens/s, CPU us per token (this process, all threads) and host us per token
        outside the forward in decode-only steps."""
        eng = self._engine(concurrency, tokens)
        reqs = self.requests(eng, concurrency, tokens)
        forward = [0.0]
        for name in ("decode", "prefill"):
            fn = getattr(eng.runner, name)

            def timed(*a: Any, _fn: Any = fn, **kw: Any) -> Any:
                t = time.thread_time()
                try:
                    return _fn(*a, **kw)
                finally:
                    forward[0] += time.thread_time() - t

            setattr(eng.runner, name, timed)
        got: list[Any] = []
        cpu0, t0 = time.process_time(), time.perf_counter()
        for r in reqs:
            eng.add_request(r, got.append)
        tokens_out = 0
        # the engine thread's CPU time (one torch thread: the forward runs on it too), which
        # other processes on a loaded machine change less than wall time
        decode_wall = decode_fwd = 0.0
        decode_tokens = 0
        while eng.has_work():
            only_decode = not eng.scheduler.waiting and eng.scheduler.prefilling is None
            f0, s0 = forward[0], time.thread_time()
            n = len(eng.step())
            if only_decode:
                decode_wall += time.thread_time() - s0
                decode_fwd += forward[0] - f0
                decode_tokens += n
            tokens_out += n
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        eng.close()
        return {
            "tokens": tokens_out,
            "tokens_per_s": tokens_out / wall,
            "cpu_us_per_token": cpu / tokens_out * 1e6,
            "host_us_per_token": (decode_wall - decode_fwd) / max(1, decode_tokens) * 1e6,
            "forward_us_per_token": decode_fwd / max(1, decode_tokens) * 1e6,
        }


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant of it (from ``/proc/*/stat``'s parent ids)."""
    parents: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += parents.get(p, [])
    return out


def cpu_by_process(pid: int) -> dict[int, float]:
    """CPU seconds (user + system, all threads) of ``pid`` and each descendant."""
    return {p: c for p in process_tree(pid) if (c := http.cpu_seconds(p)) is not None}


def ticks_by_process(pid: int) -> dict[int, float]:
    """CPU seconds of ``pid`` and each descendant from ``/proc/<pid>/stat``'s clock ticks:
    10 ms steps, but threads that exited are counted (:func:`cpu_by_process` sums the live
    threads, so a worker thread that exits between two readings drops out of it, as the
    front end's idle thread-pool threads do)."""
    out = {}
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[p] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def over_http(
    url: str, pid: int, concurrency: int, tokens: int, stream: bool, client: str = "aiohttp"
) -> dict[str, Any]:
    """All ``concurrency`` chats at once against the server at ``url`` (process ``pid``),
    sent by ``client`` (:data:`~benchmarks.host_client.CLIENTS`), every answer's token
    count checked: tokens/s and the server's CPU us per token, its own process and its
    children apart, and the load generator's (this process).

    Raises:
        AnswerError: an answer failed or had the wrong token count.
    """
    base: dict[str, Any] = {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    if stream:
        base |= {"stream": True, "stream_options": {"include_usage": True}}
    bodies = [{"messages": m, **base} for m in prompts(concurrency)]
    before, ticks = cpu_by_process(pid), ticks_by_process(pid)
    t0, c0 = time.perf_counter(), time.process_time()
    counts = send_all(client, url, bodies, stream, tokens)
    wall, client_cpu = time.perf_counter() - t0, time.process_time() - c0
    after, ticks_after = cpu_by_process(pid), ticks_by_process(pid)
    n = sum(counts)
    # the larger of the two counts: exact live-thread times, or ticks with exited threads
    used = {
        p: max(c - before.get(p, 0.0), ticks_after.get(p, 0.0) - ticks.get(p, 0.0))
        for p, c in after.items()
    }
    per = {p: u / n * 1e6 for p, u in used.items()}
    api = per.pop(pid, 0.0)
    return {
        "tokens": n,
        "tokens_per_s": n / wall,
        "api_cpu_us_per_token": api,
        "engine_cpu_us_per_token": sum(per.values()),
        "client_cpu_us_per_token": client_cpu / n * 1e6,
        "processes": 1 + len(per),
    }


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _row(
    c: int,
    mode: str,
    eng_runs: list[dict[str, Any]],
    srv: list[dict[str, Any]],
    ratios: list[float],
) -> dict[str, Any]:
    """One result row: medians over the pairs."""
    return {
        "concurrency": c,
        "mode": mode,
        "engine_tokens_per_s": _median(eng_runs, "tokens_per_s"),
        "server_tokens_per_s": _median(srv, "tokens_per_s"),
        "ratio": statistics.median(ratios),
        "api_cpu_us_per_token": _median(srv, "api_cpu_us_per_token"),
        "engine_cpu_us_per_token": _median(srv, "engine_cpu_us_per_token"),
        "client_cpu_us_per_token": _median(srv, "client_cpu_us_per_token"),
        "server_processes": max(s["processes"] for s in srv),
        "engine_alone_cpu_us_per_token": _median(eng_runs, "cpu_us_per_token"),
        "engine_host_us_per_token": _median(eng_runs, "host_us_per_token"),
        "engine_forward_us_per_token": _median(eng_runs, "forward_us_per_token"),
    }


def host(args: argparse.Namespace, model_dir: str) -> int:
    """``host``: the engine alone against the server over HTTP (streamed and plain) at
    each concurrency, interleaved pairs, medians; writes ``host.json``.

    With several ``--client`` load generators and a ``--baseline`` checkout (a second
    server, started beside this checkout's), each pair runs every (server, client)
    variant of each mode in turn, the order reversed every other pair; ``runs`` holds
    this checkout's server with the first client, ``variants`` every variant's rows.
    """
    concurrencies, tokens, pairs = SCALES[args.scale]
    if args.concurrency:
        concurrencies = tuple(int(c) for c in args.concurrency.split(","))
    tokens = args.tokens or tokens
    pairs = args.pairs or pairs
    clients = [c.strip() for c in args.client.split(",") if c.strip()]
    if not clients or any(c not in CLIENTS for c in clients):
        raise SystemExit(f"--client: a comma-separated list of {', '.join(CLIENTS)}")
    alone = EngineAlone(model_dir)
    flags = ["--max-running-requests", str(MAX_RUNNING)]
    flags += ["--max-total-tokens", str(pool_tokens(max(concurrencies), tokens))]
    variants: list[dict[str, Any]] = []
    with ExitStack() as stack:
        servers = {
            "this": stack.enter_context(http.mmserve_server(model_dir, flags, args.threads or 1))
        }
        if args.stream_interval > 1:  # this checkout again, N tokens per streamed chunk
            every = [*flags, "--stream-interval", str(args.stream_interval)]
            servers[f"this-interval{args.stream_interval}"] = stack.enter_context(
                http.mmserve_server(model_dir, every, args.threads or 1)
            )
        if args.baseline:
            repo = Path(args.baseline).resolve()
            servers["baseline"] = stack.enter_context(
                http.mmserve_server(model_dir, flags, args.threads or 1, repo=repo)
            )
        combos = [(name, client) for name in servers for client in clients]
        alone.run(4, 4)  # warm-up: first-call costs stay out of the pairs
        for url, proc in servers.values():
            for client in clients:
                over_http(url, proc.pid, 4, 4, True, client)
        for c in concurrencies:
            eng_runs: list[dict[str, Any]] = []
            got: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
            ratios: dict[tuple[str, str, str], list[float]] = {}
            for k in range(pairs):
                e = alone.run(c, tokens)
                eng_runs.append(e)
                for mode in ("streamed", "plain"):
                    for name, client in combos if k % 2 == 0 else combos[::-1]:
                        url, proc = servers[name]
                        s = over_http(url, proc.pid, c, tokens, mode == "streamed", client)
                        got.setdefault((mode, name, client), []).append(s)
                        ratios.setdefault((mode, name, client), []).append(
                            s["tokens_per_s"] / e["tokens_per_s"]
                        )
                print(f"host: c={c} engine {e['tokens_per_s']:.0f} tok/s", flush=True)
            for (mode, name, client), srv in got.items():
                row = _row(c, mode, eng_runs, srv, ratios[(mode, name, client)])
                variants.append({**row, "server": name, "client": client})
    runs = [
        {k: v for k, v in r.items() if k not in ("server", "client")}
        for r in variants
        if r["server"] == "this" and r["client"] == clients[0]
    ]
    out = {
        "meta": {
            "model": args.size or str(args.model),
            "cpus": os.cpu_count(),
            "threads": args.threads,
            "tokens": tokens,
            "pairs": pairs,
            "load": os.getloadavg()[0],
            "clients": clients,
            "baseline": args.baseline or None,
            "stream_interval": args.stream_interval,
        },
        "runs": runs,
        "variants": variants,
    }
    path = args.out / "host.json"
    path.write_text(json.dumps(out, indent=1))
    for r in sorted(
        variants, key=lambda r: (r["concurrency"], r["mode"], r["server"], r["client"])
    ):
        print(
            f"c={r['concurrency']:4d} {r['mode']:8s} {r['server']:8s} {r['client']:7s} ratio "
            f"{r['ratio']:.2f}  server {r['server_tokens_per_s']:.0f} / engine "
            f"{r['engine_tokens_per_s']:.0f} tok/s  api {r['api_cpu_us_per_token']:.0f} us/tok, "
            f"engine proc {r['engine_cpu_us_per_token']:.0f}, load generator "
            f"{r['client_cpu_us_per_token']:.0f}, engine host {r['engine_host_us_per_token']:.1f}"
        )
    print(f"wrote {path}")
    return 0


#: ``host``'s options beside the common ones.
OPTIONS: list[tuple[tuple[str, ...], dict]] = [
    (("--concurrency",), dict(default="", help="comma-separated (default by --scale)")),
    (("--tokens",), dict(type=int, default=0, help="tokens per answer (default by --scale)")),
    (("--pairs",), dict(type=int, default=0, help="interleaved rounds (default by --scale)")),
    (
        ("--client",),
        dict(
            default="aiohttp",
            help="load generators, comma-separated: aiohttp (lines counted, the usage "
            "chunk parsed) and/or httpx (every event parsed)",
        ),
    ),
    (
        ("--stream-interval",),
        dict(
            type=int,
            default=1,
            help="N > 1: a third server, this checkout with --stream-interval N",
        ),
    ),
    (
        ("--baseline",),
        dict(default="", help="a second checkout whose server runs beside this one's"),
    ),
]
