"""``mmserve`` command line: ``serve`` (the HTTP server) and ``make-model``.

Every setting of every layer is a flag, generated from its dataclass, so a
default lives in one place (the dataclass) and ``--help`` shows it:
:class:`LaunchSettings` (this process), :class:`~api.settings.ServerSettings`
(HTTP), :class:`~mmserve.config.EngineConfig` and
:class:`~mmserve.vision.image.ImageLimits` (the engine),
:class:`~api.replicas.settings.ReplicaSettings` (``--replicas``, Ray Serve). ``serve``
builds the engine and the app and hands the app object to uvicorn, or with several
replicas deploys them on Ray Serve (:mod:`api.replicas.launch`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import signal
import sys
import threading
import time
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from api.replicas.settings import ROUTERS, ReplicaSettings
from api.settings import BATCH_ORDERS, ServerSettings
from mmserve.config import ATTENTION_BACKENDS, DTYPES, POLICIES, QUANTIZATIONS, EngineConfig
from mmserve.vision.image import ImageLimits

if TYPE_CHECKING:
    from mmserve.engine.engine import Engine

log = logging.getLogger(__name__)


@dataclass
class LaunchSettings:
    """How the server process runs.

    Attributes:
        host: address to listen on (loopback by default).
        port: TCP port to listen on.
        shutdown_grace_seconds: on SIGTERM or Ctrl-C, new connections are refused and
            running requests get this long to finish before the rest are aborted (seconds).
        log_level: uvicorn's log level.
        fatal_exit_seconds: after a fault the engine cannot recover from (a
            tensor-parallel rank died or hung), keep answering (``/health`` 503, requests
            with errors) this long, then shut down and exit 1 (seconds).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    shutdown_grace_seconds: float = 30.0
    log_level: str = "info"
    fatal_exit_seconds: float = 5.0


#: Flag choices for string settings that take one of a few values.
_CHOICES = {
    "dtype": DTYPES,
    "attention_backend": ATTENTION_BACKENDS,
    "policy": POLICIES,
    "quantization": QUANTIZATIONS,
    "log_level": ("critical", "error", "warning", "info", "debug", "trace"),
    "replica_router": ROUTERS,
    "batch_order": BATCH_ORDERS,
}
#: Flag names that differ from the field name (``--model`` is the checkpoint directory).
_RENAMED = {("engine", "model_path"): "model"}


def _field_docs(cls: type) -> dict[str, str]:
    """``{field: help}`` from the ``Attributes:`` section of ``cls``'s docstring."""
    doc = cls.__doc__ or ""
    out: dict[str, str] = {}
    current = None
    for line in doc.split("Attributes:", 1)[-1].splitlines():
        m = re.match(r"^\s{8}(\w+): (.*)$", line)
        if m:
            current = m.group(1)
            out[current] = m.group(2).strip()
        elif current and line.startswith(" " * 12):
            out[current] += " " + line.strip()
        elif line.strip() and not line.startswith(" " * 12):
            current = None
    return out


def _base_type(hint: object) -> type:
    """``int`` for ``int | None`` and the like."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0]
    return hint  # type: ignore[return-value]


def _flag(group: str, name: str) -> str:
    name = _RENAMED.get((group, name), name)
    if group == "image":  # ImageLimits: --max-image-bytes, --max-image-side, ...
        name = "max_image_" + name.removeprefix("max_")
    return name


#: (group, dataclass, fields left out) in the order --help lists them.
_GROUPS = [
    ("launch", LaunchSettings, ()),
    ("engine", EngineConfig, ("image_limits",)),
    ("image", ImageLimits, ()),
    ("server", ServerSettings, ()),
    ("replicas", ReplicaSettings, ()),
]


def _add_settings(p: argparse.ArgumentParser) -> None:
    for group, cls, skip in _GROUPS:
        g = p.add_argument_group(f"{cls.__name__} ({cls.__module__})")
        docs = _field_docs(cls)
        hints = typing.get_type_hints(cls)
        defaults = cls()
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = _flag(group, f.name)
            default = getattr(defaults, f.name)
            kw: dict = {"dest": f"{group}.{f.name}", "default": default}
            kw["help"] = docs.get(f.name, "") + " [default: %(default)s]"
            base = _base_type(hints[f.name])
            if base is bool:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = base
                kw["metavar"] = {int: "N", float: "X"}.get(base, flag.split("_")[-1].upper())
                if f.name in _CHOICES:
                    kw["choices"] = list(_CHOICES[f.name])
            g.add_argument("--" + flag.replace("_", "-"), **kw)


def settings_from_args(
    args: argparse.Namespace,
) -> tuple[LaunchSettings, EngineConfig, ServerSettings]:
    """The typed settings a parsed ``serve`` command line gives.

    Raises:
        ValueError: for a setting out of range (the message names it).
    """
    values: dict[str, dict] = {group: {} for group, _, _ in _GROUPS}
    for key, value in vars(args).items():
        if "." in key:
            group, name = key.split(".", 1)
            values[group][name] = value
    launch = LaunchSettings(**values["launch"])
    engine = EngineConfig(**values["engine"], image_limits=ImageLimits(**values["image"]))
    server = ServerSettings(**values["server"])
    engine.validate()
    server.validate()
    if launch.shutdown_grace_seconds < 0 or launch.fatal_exit_seconds < 0:
        raise ValueError("shutdown_grace_seconds and fatal_exit_seconds must be >= 0")
    return launch, engine, server


def replica_settings_from_args(args: argparse.Namespace) -> ReplicaSettings:
    """The :class:`ReplicaSettings` a parsed ``serve`` command line gives.

    Raises:
        ValueError: for a setting out of range (the message names it).
    """
    prefix = "replicas."
    values = {k[len(prefix) :]: v for k, v in vars(args).items() if k.startswith(prefix)}
    settings = ReplicaSettings(**values)
    settings.validate()
    return settings


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from api.app import create_app
    from mmserve.distributed.group import TPGroupError
    from mmserve.engine.engine import Engine
    from mmserve.kernels.select import BackendUnavailableError, resolve_attention_backend
    from mmserve.testing.checkpoints import ensure_model

    try:
        launch, config, server = settings_from_args(args)
        replicas = replica_settings_from_args(args)
    except ValueError as e:
        print(f"mmserve serve: error: {e}", file=sys.stderr)
        return 2
    if replicas.uses_ray:  # several engine replicas on Ray Serve (api/replicas/)
        from api.replicas.launch import serve_replicas

        return serve_replicas(launch, config, server, replicas)
    config.model_path = config.model_path or str(ensure_model("tiny"))
    try:  # fail here, with the fix in the message, not inside the server's startup
        resolve_attention_backend(config.attention_backend, config.device, config.torch_dtype())
    except BackendUnavailableError as e:
        print(f"mmserve serve: error: {e}", file=sys.stderr)
        return 2
    try:  # a checkpoint it cannot load, a KV budget too small, a --tp it cannot split
        engine = Engine(config)
    except (ValueError, TPGroupError) as e:
        print(f"mmserve serve: error: {e}", file=sys.stderr)
        return 2
    app = create_app(engine, server)
    uv = uvicorn.Config(
        app,
        host=launch.host,
        port=launch.port,
        log_level=launch.log_level,
        timeout_graceful_shutdown=launch.shutdown_grace_seconds,
    )
    # uvicorn handles SIGTERM/SIGINT: it stops accepting, waits up to the grace period
    # for running requests, then the app's shutdown aborts what is left. Afterwards it
    # re-raises the signal to the handler it found; a no-op one makes that exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    userver = uvicorn.Server(uv)
    _exit_on_fatal(engine, userver, launch.fatal_exit_seconds)
    userver.run()
    return 1 if engine.fatal_error() else 0


def _exit_on_fatal(engine: Engine, userver: object, delay: float) -> None:
    """Shut ``userver`` down ``delay`` seconds after ``engine`` reports a fatal fault
    (uvicorn's graceful shutdown: the app's lifespan ends the requests and the workers)."""

    def watch() -> None:
        while not userver.should_exit:
            why = engine.fatal_error()
            if why is not None:
                log.error("%s; shutting down in %.1f s", why, delay)
                time.sleep(delay)
                userver.should_exit = True
                return
            time.sleep(0.25)

    threading.Thread(target=watch, name="mmserve-fatal-watch", daemon=True).start()


def build_parser() -> argparse.ArgumentParser:
    """The ``mmserve`` argument parser (also used by tests)."""
    from mmserve.cli import add_make_model_parser

    p = argparse.ArgumentParser(prog="mmserve", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        help="run the HTTP server",
        description="Run the OpenAI-compatible HTTP server (one engine, or --replicas N).",
    )
    _add_settings(s)
    s.set_defaults(func=_serve)
    add_make_model_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mmserve`` console script."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
