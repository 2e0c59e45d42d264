"""The benchmark CLI: ``python -m benchmarks <subcommand> [options]`` (``--help`` lists them)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

try:  # the HTTP runner's client, from the bench (or test) extra
    import httpx  # noqa: F401
except ImportError:
    sys.exit('python -m benchmarks needs httpx: pip install -e ".[bench]"')

from benchmarks import (
    cache_salt,
    conversation,
    determinism,
    engine_process,
    experiments,
    graph_decode,
    host,
    hub_load,
    image_repeat,
    kv_fp8,
    live_video,
    llamacpp_decode,
    model_identity,
    output,
    quant_rows,
    real_shapes,
    spec,
    suites,
    tracing_overhead,
    video_followup,
    workloads,
)
from benchmarks.in_process import model_dir as checkpoint


def _qa(images: int, questions: int) -> list[tuple[tuple[str, ...], dict]]:
    """``--images``, ``--questions`` and ``--max-tokens`` (4) of the photo-question runs."""
    pairs = (("--images", images), ("--questions", questions), ("--max-tokens", 4))
    return [((flag,), dict(type=int, default=n)) for flag, n in pairs]


#: subcommand -> (function, default scale, size, family, extra options: (flags, kwargs)).
COMMANDS: dict[str, tuple[Any, str, str | None, str, list[tuple[tuple[str, ...], dict]]]] = {
    "run": (suites.engine_suite, "full", "small", "llava", [
        (("--workloads",), dict(default="", help=f"of {','.join(workloads.ENGINE_WORKLOADS)}")),
        (("--policies",), dict(default=",".join(suites.POLICIES), help="cache-on policies")),
        (("--no-baseline",), dict(action="store_true", help="skip transformers")),
        (("--no-sweep",), dict(action="store_true", help="skip the KV-pool sweep")),
        (("--lockstep",), dict(action="store_true", help="multi_turn in lock-step rounds")),
        (("--baseline-max",), dict(type=int, default=-1, help="transformers requests (0: all)")),
    ]),
    "serve": (suites.http_suite, "full", None, "llava", [
        (("--url",), dict(action="append", default=[], metavar="NAME=URL",
                          help="a running OpenAI-compatible server (repeatable)")),
        (("--servers",), dict(default=",".join(suites.SERVERS))),
        (("--workloads",), dict(default="", help=f"of {','.join(workloads.HTTP_WORKLOADS)}")),
        (("--rates",), dict(help="offered req/s, comma-separated, inf = burst")),
        (("--llamacpp-dir",), dict(type=Path, help="setup folder (default .llamacpp)")),
        (("--no-llamacpp",), dict(action="store_true")),
        (("--no-bound",), dict(action="store_true", help="skip the cost bound")),
        (("--no-overhead",), dict(action="store_true", help="skip the HTTP-overhead step")),
    ]),
    "real-shapes": (real_shapes.real_shapes, "full", "onevision-0.5b", "llava-onevision", [
        (("--dtypes",), dict(default="bfloat16,float32")),
        (("--tokens",), dict(type=int, default=16, help="answer length (tokens)")),
        (("--repeats",), dict(type=int, default=2)),
        (("--batch",), dict(type=int, default=8, help="concurrent answers")),
        (("--parts",), dict(default="compare,decode", help="compare, decode and/or quant")),
        (("--decode-batches",), dict(default="1,4,8,16")),
        (("--decode-tokens",), dict(type=int, default=8, help="decode steps per run")),
        (("--bandwidth-gb",), dict(type=float, default=1.0, help="tensor read for GB/s (GiB)")),
        (("--quality-positions",), dict(type=int, default=2000, help="quant: teacher-forced")),
        (("--quant-methods",), dict(default="int8,int4", help="quant: against none")),
        (("--image-check",), dict(action=argparse.BooleanOptionalAction, default=True,
                                  help="quant: the image-sensitivity check")),
    ]),
    "llamacpp-decode": (llamacpp_decode.llamacpp_decode, "full", "onevision-0.5b",
                        "llava-onevision", llamacpp_decode.OPTIONS),
    "host": (host.host, "full", "tiny", "llava", host.OPTIONS),
    "image-repeat": (image_repeat.image_repeat, "full", "tiny", "llava", image_repeat.OPTIONS),
    "determinism": (determinism.determinism, "full", "tiny", "llava", determinism.OPTIONS),
    "graph-decode": (graph_decode.run, "full", "small", "llava", graph_decode.OPTIONS),
    "spec": (spec.run, "full", "small", "llava", spec.OPTIONS),
    "replicas": (experiments.replicas, "full", "tiny", "llava", [
        (("--port",), dict(type=int, default=8470, help="HTTP port of the endpoint")),
    ]),
    "structured": (experiments.structured, "full", "small", "llava", [
        (("--requests",), dict(type=int, help="per run (default 32; 16 with --quick)")),
        (("--max-tokens",), dict(type=int, default=256)),
    ]),
    "engine-process": (engine_process.engine_process, "quick", "tiny", "llava", [
        (("--rounds",), dict(type=int, default=5, help="interleaved rounds")),
        (("--ttft-probes",), dict(type=int, default=5, help="single requests per round")),
        (("--concurrency",), dict(type=int, default=128, help="streams per burst")),
        (("--tokens",), dict(type=int, default=64, help="tokens per stream")),
        (("--repo",), dict(action="append", help="another checkout to run both servers from")),
    ]),
    "tracing": (tracing_overhead.tracing_overhead, "quick", "tiny", "llava", [
        (("--repeats",), dict(type=int, default=8, help="off/on pairs")),
    ]),
    "batch-order": (experiments.batch_order, "full", "tiny", "llava", [
        *_qa(40, 5), (("--max-total-tokens",), dict(type=int, default=4096, help="KV pool")),
    ]),
    "batch-api": (experiments.batch_api, "full", "tiny", "llava", [
        *_qa(40, 10), (("--max-total-tokens",), dict(type=int, default=4096, help="KV pool")),
        (("--probes",), dict(type=int, default=20, help="TTFT probes before and after")),
        (("--probe-period",), dict(type=float, default=0.3, help="seconds between probes")),
        (("--ttft-scale",), dict(type=int, default=3, help="photos x this in the TTFT batch")),
        (("--replicas",), dict(type=int, default=1, help="replicas (Ray Serve)")),
    ]),
    "kv-tiers": (experiments.kv_tiers, "full", "tiny", "llava", [
        *_qa(16, 3),
        (("--pool-images",), dict(type=float, default=2.0, help="pool size in photos' KV")),
        (("--page-size",), dict(type=int, default=16)),
        (("--concurrency",), dict(type=int, default=2)),
        (("--ttft-images",), dict(type=int, default=6, help="photos of the TTFT part")),
        (("--cold",), dict(action=argparse.BooleanOptionalAction, default=True,
                           help="drop the disk files from the page cache before TTFT loads")),
    ]),
    "image-memory": (experiments.image_memory, "full", None, "llava", [
        (("--repo",), dict(action="append", help="checkout(s) to run the server from")),
        (("--side",), dict(type=int, default=6000, help="image side (pixels)")),
        (("flags",), dict(nargs="*", help="extra `mmserve serve` flags (after --)")),
    ]),
    "kv-fp8": (kv_fp8.kv_fp8, "full", "small", "llava", [
        (("--pool-size",), dict(default="tiny", help="model of the capacity and hit-rate parts")),
        (("--over",), dict(type=int, default=8, help="working set / bf16 pool (photos)")),
        (("--positions",), dict(type=int, default=2000, help="teacher-forced positions")),
    ]),
    "model-identity": (model_identity.model_identity, "full", "onevision-0.5b",
                       "llava-onevision", model_identity.OPTIONS),
    "hub-load": (hub_load.hub_load, "full", "small", "llava", hub_load.OPTIONS),
    "conversation": (conversation.conversation, "full", "small", "llava", conversation.OPTIONS),
    "video-qa": (experiments.video_qa, "full", "small", "llava", [
        (("--num-frames",), dict(type=int, default=8)),
        (("--max-tokens",), dict(type=int, default=16)),
    ]),
    "video-followup": (video_followup.video_followup, "full", "small", "llava-next-video",
                       video_followup.OPTIONS),
    "live-video": (live_video.live_video, "full", "small", "llava-onevision",
                   live_video.OPTIONS),
    "video-budget": (experiments.video_budget, "full", "small", "llava-onevision", [
        (("--seconds",), dict(type=int, default=60, help="clip length (10 fps)")),
        (("--max-video-tokens",), dict(type=int, default=4096)),
        (("--max-video-frames",), dict(type=int, default=64)),
        (("--max-total-tokens",), dict(type=int, default=16384, help="KV pool")),
    ]),
    "quant-rows": (quant_rows.quant_rows, "full", None, "llava", [
        (("--rows",), dict(default="1,2,4,8,16,32,64", help="row counts (M)")),
        (("--rounds",), dict(type=int, default=15, help="interleaved rounds")),
    ]),
    "output": (output.output, "full", "tiny", "llava", [
        (("--repo",), dict(action="append", type=Path, help="another checkout to compare")),
        (("--rounds",), dict(type=int, default=5, help="interleaved rounds (full scale)")),
        (("--requests",), dict(type=int, default=128, help="concurrent requests")),
        (("--tokens",), dict(type=int, default=128, help="tokens per answer")),
    ]),
    "salt": (cache_salt.cache_salt, "full", "tiny", "llava", cache_salt.OPTIONS),
    "image-detail": (experiments.image_detail, "full", None, "llava-next", [
        (("--families",), dict(default="llava-onevision,llava-next")),
        (("--photo",), dict(default="1024x768", help="WxH of the photo")),
        (("--repeats",), dict(type=int, default=5, help="requests per view and round")),
    ]),
}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    """The CLI's parser: :data:`COMMANDS` (with the common options) plus ``llamacpp`` and
    ``plot``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name, (fn, scale, size, family, extra) in COMMANDS.items():
        # options added per subcommand: argparse's `parents` would share one action object,
        # and each set_defaults would overwrite the others' defaults
        p = sub.add_parser(name, help=fn.__doc__.splitlines()[0].strip("`: "))
        p.add_argument("--scale", choices=("ci", "quick", "full"), default=scale)
        p.add_argument("--quick", action="store_const", const="quick", dest="scale")
        p.add_argument("--size", default=size, help="tiny, small or a real shape (make-model)")
        p.add_argument(
            "--family", choices=("llava", "llava-next", "llava-onevision", "llava-next-video")
        )
        p.add_argument("--model", help="checkpoint directory or Hub id (overrides --size)")
        p.add_argument("--revision", help="revision of a Hub id --model")
        p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
        p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's)")
        p.add_argument("--seed", type=int, default=0)
        p.set_defaults(family=family)
        for flags, kw in extra:
            p.add_argument(*flags, **kw)
    ll = sub.add_parser("llamacpp", help="setup helpers of scripts/setup_llamacpp.sh")
    ll.add_argument(
        "step", choices=("make-checkpoint", "export-lm", "vit-dir", "export-qwen2", "convert-lm")
    )
    ll.add_argument(
        "paths", nargs="+", type=Path,
        help="OUT | HF OUT | HF SURGERY OUT | OUT (export-qwen2) | SRC MODEL OUT (convert-lm)",
    )  # fmt: skip
    ll.add_argument("--size", default="small")
    ll.add_argument("--outtype", default="f16", help="convert-lm: the GGUF's float type")
    ll.add_argument("--seed", type=int, default=0)
    pl = sub.add_parser("plot", help="PNG plots from the JSON results in RESULTS_DIR")
    pl.add_argument("results", type=Path, metavar="RESULTS_DIR")
    pl.add_argument("--out", type=Path, help="folder of the PNG files (default RESULTS_DIR)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the exit code."""
    args = parser().parse_args(argv)
    if args.command == "plot":
        from benchmarks import plot

        return plot.main(args.results, args.out)
    if args.command == "llamacpp":
        from benchmarks import llamacpp

        t0, p = time.perf_counter(), args.paths
        if args.step == "make-checkpoint":
            p = [p[0], args.size, args.seed]
        elif args.step == "export-qwen2":  # the seeded OneVision checkpoint of --size
            p = [Path(checkpoint(args.size, "llava-onevision")), p[0]]
        elif args.step == "convert-lm":
            p = [*p, args.outtype]
        steps = {
            "make-checkpoint": llamacpp.make_sp_checkpoint,
            "vit-dir": llamacpp.write_vit_dir,
            "export-lm": llamacpp.export_language_model,
            "export-qwen2": llamacpp.export_qwen2_lm,
            "convert-lm": llamacpp.convert_lm,
        }
        print(steps[args.step](*p))
        print(f"{args.step}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    model = None
    if args.size or args.model:
        model = checkpoint(args.size, args.family, args.model, args.revision)
    return COMMANDS[args.command][0](args, model)


if __name__ == "__main__":
    raise SystemExit(main())
