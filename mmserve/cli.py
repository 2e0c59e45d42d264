"""Core commands: ``make-model`` (a seeded random checkpoint).

The ``mmserve`` console script lives in :mod:`api.cli`, which adds ``serve``
(the HTTP server) and reuses the parser built here, so the core package
carries no HTTP flags.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


class _RegistryChoices(Sequence[str]):
    """``FAMILY_NAMES`` or ``SIZES`` of :mod:`mmserve.testing.checkpoints`, read on first use:
    they come from the family registry, whose import loads transformers' model code, which
    ``mmserve --help`` and ``mmserve serve`` should not wait for."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _values(self) -> tuple[str, ...]:
        from mmserve.testing import checkpoints

        return getattr(checkpoints, self.name)

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        return self._values()[i]

    def __len__(self) -> int:
        return len(self._values())


def _make_model(args: argparse.Namespace) -> int:
    import logging
    import tempfile

    from mmserve.testing.checkpoints import make_checkpoint

    if args.dir is None and not args.hub_cache:
        print("make-model: give DIR, or --hub-cache CACHE --repo-id ORG/NAME", file=sys.stderr)
        return 2
    if args.dir is None:  # only the Hub cache entry: the checkpoint is written aside first
        with tempfile.TemporaryDirectory() as tmp:
            args.dir = str(Path(tmp) / "checkpoint")
            return _make_model(args)

    # the weight writer's progress (bytes, percent, rate per file) on stderr
    progress = logging.getLogger("mmserve.testing.weights")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("make-model: %(message)s"))
    progress.addHandler(handler)
    level = progress.level
    progress.setLevel(logging.INFO)
    try:
        path = make_checkpoint(
            args.dir,
            size=args.size,
            seed=args.seed,
            family=args.family,
            dtype=args.dtype,
            quantization=args.quantization,
            variant=args.variant,
            group_size=args.group_size,
            symmetric=False if args.asymmetric else None,
        )
        if args.hub_cache:
            from mmserve.testing.hub_cache import write_hub_cache

            if not args.repo_id:
                raise ValueError("--hub-cache needs --repo-id org/name")
            path = write_hub_cache(path, args.hub_cache, args.repo_id, args.revision)
    except ValueError as e:
        print(f"make-model: {e}", file=sys.stderr)
        return 2
    finally:
        progress.removeHandler(handler)
        progress.setLevel(level)
    print(path)
    return 0


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default unless it is None (those options say their default in words)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def add_make_model_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``make-model [DIR] [--size] [--seed] [--family] [--dtype] [--quantization]
    [--variant] [--hub-cache CACHE --repo-id ORG/NAME [--revision]]`` to a
    subcommand set."""
    m = sub.add_parser(
        "make-model",
        help="write a seeded random LLaVA-1.5, LLaVA-NeXT or LLaVA-OneVision checkpoint",
        formatter_class=_DefaultsHelp,
    )
    m.add_argument(
        "dir", nargs="?", default=None, help="directory to write (optional with --hub-cache)"
    )
    m.add_argument(
        "--size",
        choices=_RegistryChoices("SIZES"),
        metavar="SIZE",  # a metavar keeps argparse from reading the choices before use
        default="tiny",
        help="%(choices)s. tiny: 1M parameters (tests); small: 28M (CPU benchmarks); the "
        "others: a real model's exact shapes with seeded random weights (onevision-0.5b: "
        "LLaVA-OneVision-0.5B, 1.8 GB in bf16; the 7b ones about 14 GB each in bf16)",
    )
    m.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    m.add_argument(
        "--family",
        choices=_RegistryChoices("FAMILY_NAMES"),
        metavar="FAMILY",
        default=None,
        help="%(choices)s. llava: LLaVA-1.5 (576 tokens per image); llava-next: "
        "any-resolution tiles; llava-onevision: SigLIP + Qwen2, any-resolution grid and "
        "pooled video frames (default: llava, or the family of a real --size)",
    )
    m.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="stored weight dtype (default: float32 for tiny/small, bfloat16 for real shapes)",
    )
    m.add_argument(
        "--quantization",
        choices=("none", "int8", "fp8", "int4", "awq", "gptq"),
        default="none",
        help="store the decoder's projections quantized, as the tools write them: int8 or "
        "fp8 (compressed-tensors, e4m3 or int8 weights, per-channel scales), int4 "
        "(compressed-tensors pack-quantized W4A16, symmetric), awq (AWQ gemm) or gptq "
        "(GPTQ, desc_act false); serving it loads them as they are",
    )
    m.add_argument(
        "--group-size",
        type=int,
        choices=(32, 64, 128),
        default=128,
        help="input features per scale of the 4-bit formats",
    )
    m.add_argument(
        "--asymmetric",
        action="store_true",
        help="4-bit formats: store zero points (int4, gptq; awq always does)",
    )
    m.add_argument(
        "--variant",
        choices=("llava-video",),
        default=None,
        help="a checkpoint of the family's architecture with another model's settings: "
        "llava-video: LLaVA-Video-7B-Qwen2's on the OneVision layout (anyres_max_4, a 3x3 "
        "grid, its pooling and frame settings; implies --family llava-onevision)",
    )
    m.add_argument(
        "--hub-cache",
        metavar="CACHE",
        default=None,
        help="also lay the checkpoint out in this Hugging Face Hub cache folder (HF_HOME/hub) "
        "as --repo-id at --revision, so `serve --model ORG/NAME` finds it offline; prints "
        "the snapshot path",
    )
    m.add_argument("--repo-id", default=None, help="Hub id of --hub-cache (org/name)")
    m.add_argument("--revision", default="main", help="branch or tag of --hub-cache")
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
