"""Core commands: ``make-model`` (a seeded random checkpoint).

The ``mmserve`` console script lives in :mod:`api.cli`, which adds ``serve``
(the HTTP server) and reuses the parser built here, so the core package
carries no HTTP flags.
"""

from __future__ import annotations

import argparse
import sys

from mmserve.testing.checkpoints import FAMILY_NAMES, SIZES


def _make_model(args: argparse.Namespace) -> int:
    from mmserve.testing.checkpoints import make_checkpoint

    try:
        path = make_checkpoint(
            args.dir, size=args.size, seed=args.seed, family=args.family, dtype=args.dtype
        )
    except ValueError as e:
        print(f"make-model: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def add_make_model_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``make-model DIR [--size] [--seed] [--family] [--dtype]`` to a subcommand set."""
    m = sub.add_parser(
        "make-model",
        help="write a seeded random LLaVA-1.5, LLaVA-NeXT or LLaVA-OneVision checkpoint",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m.add_argument("dir", help="directory to write")
    m.add_argument(
        "--size",
        choices=list(SIZES),
        default="tiny",
        help="tiny (1M parameters, tests), small (28M, CPU benchmarks), or the exact shapes "
        "of a real model with seeded random weights: onevision-0.5b (LLaVA-OneVision-0.5B, "
        "1.8 GB in bf16), llava-1.5-7b, llava-next-7b (about 14 GB each in bf16)",
    )
    m.add_argument("--seed", type=int, default=0)
    m.add_argument(
        "--family",
        choices=FAMILY_NAMES,
        default=None,
        help="llava: LLaVA-1.5 (576 tokens per image); llava-next: any-resolution tiles; "
        "llava-onevision: SigLIP + Qwen2, any-resolution grid and pooled video frames "
        "(default: llava, or the family of a real --size)",
    )
    m.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="stored weight dtype (default: float32 for tiny/small, bfloat16 for real shapes)",
    )
    m.set_defaults(func=_make_model)
    return m


def main(argv: list[str] | None = None) -> int:
    """``python -m mmserve.cli make-model DIR``."""
    p = argparse.ArgumentParser(prog="python -m mmserve.cli", description=__doc__.splitlines()[0])
    add_make_model_parser(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
