"""``mmserve`` command line: ``serve`` and ``make-model``.

``serve`` hands uvicorn the app factory ``api.app:app_from_env`` by its import
string, with the settings in the ``MMSERVE_SERVER_CONFIG`` environment
variable, so nothing in :mod:`mmserve` imports :mod:`api`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from mmserve.config import ATTENTION_BACKENDS, DTYPES, POLICIES, EngineConfig
from mmserve.server_flags import add_server_args, apply_server_args


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from mmserve.model.make_checkpoint import ensure_model

    model = args.model or str(ensure_model("tiny"))
    cfg = EngineConfig(
        model_path=model,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        disable_radix_cache=args.disable_radix_cache,
        policy=args.policy,
        decode_reserve_ratio=args.decode_reserve_ratio,
        max_wait_seconds=args.max_wait_seconds,
    )
    cfg.validate()
    from mmserve.kernels.select import BackendUnavailableError, resolve_attention_backend

    try:  # fail here, with the fix in the message, not inside the server's startup
        resolve_attention_backend(cfg.attention_backend, cfg.device, cfg.torch_dtype())
    except BackendUnavailableError as e:
        print(f"mmserve serve: error: {e}", file=sys.stderr)
        return 2
    settings = asdict(cfg)
    apply_server_args(args, settings)
    os.environ["MMSERVE_SERVER_CONFIG"] = json.dumps(settings)
    uvicorn.run(
        "api.app:app_from_env", factory=True, host=args.host, port=args.port, log_level="info"
    )
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from mmserve.model.make_checkpoint import make_checkpoint

    path = make_checkpoint(args.dir, size=args.size, seed=args.seed)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used by tests)."""
    p = argparse.ArgumentParser(prog="mmserve", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = EngineConfig()

    s = sub.add_parser(
        "serve", help="run the HTTP server", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    s.add_argument("--model", help="checkpoint directory (default: build the tiny model)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--device", default=d.device)
    s.add_argument(
        "--dtype",
        choices=DTYPES,
        default=d.dtype,
        help="model and KV dtype (auto: float32 on cpu, bfloat16 on cuda)",
    )
    s.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default=d.attention_backend,
        help="auto: flashinfer on cuda when installed (fp16/bf16), else torch",
    )
    s.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    s.add_argument(
        "--max-total-tokens", type=int, default=d.max_total_tokens, help="KV pool size in tokens"
    )
    s.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    s.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens)
    s.add_argument(
        "--disable-radix-cache", action="store_true", help="never reuse KV across requests"
    )
    s.add_argument("--policy", choices=list(POLICIES), default=d.policy, help="waiting-queue order")
    s.add_argument(
        "--decode-reserve-ratio",
        type=float,
        default=d.decode_reserve_ratio,
        help="fraction of max_tokens reserved at admission (1.0: never retract)",
    )
    s.add_argument(
        "--max-wait-seconds",
        type=float,
        default=d.max_wait_seconds,
        help="starvation guard: admit a request waiting this long first",
    )
    add_server_args(s)
    s.set_defaults(func=_serve)

    m = sub.add_parser("make-model", help="write a seeded random LLaVA-1.5 checkpoint")
    m.add_argument("dir")
    m.add_argument("--size", choices=["tiny", "small"], default="tiny")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=_make_model)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mmserve`` console script."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
