"""The benchmark CLI: ``python -m benchmarks <subcommand> [options]`` (``--help`` lists them).

Every subcommand takes ``--scale ci|quick|full`` (``--quick``), ``--size tiny|small``,
``--family``, ``--model DIR`` (overrides both), ``--out DIR`` (default
``benchmarks/results/``, git-ignored), ``--threads N`` (torch threads here and in each
server; default 1: on a shared 2-core machine two OpenMP threads can be 10x slower) and
``--seed``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import experiments, suites, workloads
from benchmarks.in_process import model_dir as checkpoint

#: subcommand -> (function, default scale, default size, extra options: (flags, kwargs)).
COMMANDS: dict[str, tuple[Any, str, str | None, list[tuple[tuple[str, ...], dict]]]] = {
    "run": (suites.engine_suite, "full", "small", [
        (("--workloads",), dict(default="", help=f"of {','.join(workloads.ENGINE_WORKLOADS)}")),
        (("--policies",), dict(default=",".join(suites.POLICIES), help="cache-on policies")),
        (("--no-baseline",), dict(action="store_true", help="skip transformers")),
        (("--no-sweep",), dict(action="store_true", help="skip the KV-pool sweep")),
        (("--lockstep",), dict(action="store_true", help="multi_turn in lock-step rounds")),
        (("--baseline-max",), dict(type=int, default=-1, help="transformers requests (0: all)")),
    ]),
    "serve": (suites.http_suite, "full", None, [
        (("--url",), dict(action="append", default=[], metavar="NAME=URL",
                          help="a running OpenAI-compatible server (repeatable)")),
        (("--servers",), dict(default=",".join(suites.SERVERS))),
        (("--workloads",), dict(default="", help=f"of {','.join(workloads.HTTP_WORKLOADS)}")),
        (("--rates",), dict(help="offered req/s, comma-separated, inf = burst")),
        (("--slo-ttft",), dict(type=float, default=5.0, help="goodput SLO on TTFT (s)")),
        (("--slo-tpot",), dict(type=float, default=0.5, help="goodput SLO on TPOT (s)")),
        (("--llamacpp-dir",), dict(type=Path, help="setup folder (default .llamacpp)")),
        (("--llamacpp-slots",), dict(type=int, default=4, help="llama-server -np")),
        (("--no-llamacpp",), dict(action="store_true")),
        (("--no-bound",), dict(action="store_true", help="skip the cost bound")),
        (("--bound",), dict(action="store_true", help="measure the bound with --url too")),
        (("--no-overhead",), dict(action="store_true", help="skip the HTTP-overhead step")),
        (("--no-agreement",), dict(action="store_true", help="skip the llama.cpp agreement")),
    ]),
    "replicas": (experiments.replicas, "full", "tiny", [
        (("--port",), dict(type=int, default=8470, help="HTTP port of the endpoint")),
    ]),
    "structured": (experiments.structured, "full", "small", [
        (("--requests",), dict(type=int, help="per run (default 32; 16 with --quick)")),
        (("--max-tokens",), dict(type=int, default=256)),
    ]),
    "batch-order": (experiments.batch_order, "full", "tiny", [
        (("--images",), dict(type=int, default=40)),
        (("--questions",), dict(type=int, default=5)),
        (("--max-tokens",), dict(type=int, default=4)),
        (("--max-total-tokens",), dict(type=int, default=4096, help="KV pool (tokens)")),
    ]),
    "tensor-parallel": (experiments.tensor_parallel, "full", "small", [
        (("--tp",), dict(type=int, default=2)),
        (("--batch",), dict(type=int, default=4)),
        (("--tokens",), dict(type=int, default=32)),
    ]),
    "image-memory": (experiments.image_memory, "full", None, [
        (("--repo",), dict(action="append", help="checkout(s) to run the server from")),
        (("--side",), dict(type=int, default=6000, help="image side (pixels)")),
        (("flags",), dict(nargs="*", help="extra `mmserve serve` flags (after --)")),
    ]),
    "video-qa": (experiments.video_qa, "full", "small", [
        (("--num-frames",), dict(type=int, default=8)),
        (("--max-tokens",), dict(type=int, default=16)),
    ]),
    "long-stream": (experiments.long_stream, "full", "tiny", [
        (("--tokens",), dict(type=int, default=6000)),
        (("--window",), dict(type=int, default=300)),
    ]),
}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    """The CLI's parser: :data:`COMMANDS` plus ``llamacpp`` (setup helpers)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name, (fn, scale, size, extra) in COMMANDS.items():
        p = sub.add_parser(name, help=fn.__doc__.splitlines()[0].strip("`: "))
        p.add_argument("--scale", choices=("ci", "quick", "full"), default=scale)
        p.add_argument("--quick", action="store_const", const="quick", dest="scale")
        p.add_argument("--size", choices=("tiny", "small"), default=size)
        p.add_argument("--family", choices=("llava", "llava-next", "llava-onevision"),
                       default="llava")  # fmt: skip
        p.add_argument("--model", type=Path, help="checkpoint directory (overrides --size)")
        p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
        p.add_argument("--threads", type=int, default=1 if name != "tensor-parallel" else 2)
        p.add_argument("--seed", type=int, default=0)
        for flags, kw in extra:
            p.add_argument(*flags, **kw)
    ll = sub.add_parser("llamacpp", help="setup helpers of scripts/setup_llamacpp.sh")
    ll.add_argument("step", choices=("make-checkpoint", "export-lm", "vit-dir"))
    ll.add_argument("paths", nargs="+", type=Path, help="OUT | HF OUT | HF SURGERY OUT")
    ll.add_argument("--size", default="small")
    ll.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the exit code."""
    args = parser().parse_args(argv)
    if args.command == "llamacpp":
        from benchmarks import llamacpp

        t0, p = time.perf_counter(), args.paths
        if args.step == "make-checkpoint":
            print(llamacpp.make_sp_checkpoint(p[0], args.size, args.seed))
        elif args.step == "export-lm":
            print(llamacpp.export_language_model(*p))
        else:
            print(llamacpp.write_vit_dir(*p))
        print(f"{args.step}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        return 0
    fn = COMMANDS[args.command][0]
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    model = checkpoint(args.size, args.family, args.model) if args.size or args.model else None
    return fn(args, model)


if __name__ == "__main__":
    raise SystemExit(main())
