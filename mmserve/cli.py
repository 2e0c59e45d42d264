"""Core commands: ``make-model`` (a seeded random checkpoint).

The ``mmserve`` console script lives in :mod:`api.cli`, which adds ``serve``
(the HTTP server) and reuses the parser built here, so the core package
carries no HTTP flags.
"""

from __future__ import annotations

import argparse
import sys

from mmserve.model.make_checkpoint import FAMILY_NAMES


def _make_model(args: argparse.Namespace) -> int:
    from mmserve.model.make_checkpoint import make_checkpoint

    path = make_checkpoint(args.dir, size=args.size, seed=args.seed, family=args.family)
    print(path)
    return 0


def add_make_model_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``make-model DIR [--size] [--seed]`` to a subcommand set."""
    m = sub.add_parser(
        "make-model",
        help="write a seeded random LLaVA-1.5, LLaVA-NeXT or LLaVA-OneVision checkpoint",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m.add_argument("dir", help="directory to write")
    m.add_argument("--size", choices=["tiny", "small"], default="tiny")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument(
        "--family",
        choices=FAMILY_NAMES,
        default="llava",
        help="llava: LLaVA-1.5 (576 tokens per image); llava-next: any-resolution tiles; "
        "llava-onevision: SigLIP + Qwen2, any-resolution grid and pooled video frames",
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
