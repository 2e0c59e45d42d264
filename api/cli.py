"""``mmserve`` command line: ``serve`` (the HTTP server) and ``make-model``.

Every setting of every layer is a flag, generated from its dataclass, so a
default lives in one place (the dataclass) and ``--help`` shows it:
:class:`LaunchSettings` (this process), :class:`~api.settings.ServerSettings`
(HTTP), :class:`~mmserve.config.EngineConfig` and
:class:`~mmserve.vision.image.ImageLimits` (the engine),
:class:`~mmserve.fleet.settings.ReplicaSettings` (``--replicas``, Ray Serve). ``serve``
builds the engine and the app and hands the app object to uvicorn, or with several
replicas deploys them on Ray Serve (:mod:`api.replicas.launch`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import errno
import logging
import logging.config
import re
import signal
import sys
import textwrap
import threading
import time
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from api.settings import BATCH_ORDERS, RESPONSE_STORES, ServerSettings
from api.startup import log_startup
from mmserve.config import (
    ATTENTION_BACKENDS,
    CHECKPOINT_QUANTIZATIONS,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_WRITE_POLICIES,
    POLICIES,
    QUANTIZATIONS,
    SPECULATIVE_METHODS,
    EngineConfig,
)
from mmserve.fleet.settings import ROUTERS, ReplicaSettings
from mmserve.vision.image import ImageLimits

if TYPE_CHECKING:
    from mmserve.frontend.engine_client import EngineProcessClient
    from mmserve.frontend.frontend import Engine, FrontEnd

log = logging.getLogger("api.cli")  # not __main__ under python -m api.cli


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
            tensor-parallel rank died or hung, or the engine process died with no restart
            left), keep answering (``/health`` 503, requests with errors) this long, then
            shut down and exit 1 (seconds).
        engine_in_process: run the engine core on a thread of the HTTP process (one
            process, for debugging) instead of in its own process.
        engine_restarts: times a dead engine process (killed, out of memory, a CUDA
            error) is replaced by a new one before the server gives up and exits 1.
        engine_call_timeout: seconds a control call to the engine process (``/metrics``,
            ``/v1/cache/stats``; ``/v1/cache/flush`` gets four times as long) waits for
            its answer; past it the route answers 503 ``engine_timeout`` and ``/health``
            503 until the engine answers again (an engine silent for 5 s is pinged with
            the same deadline).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    shutdown_grace_seconds: float = 30.0
    log_level: str = "info"
    fatal_exit_seconds: float = 5.0
    engine_in_process: bool = False
    engine_restarts: int = 3
    engine_call_timeout: float = 30.0


#: Flag choices for string settings that take one of a few values.
_CHOICES = {
    "dtype": DTYPES,
    "attention_backend": ATTENTION_BACKENDS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "kv_write_policy": KV_WRITE_POLICIES,
    "policy": POLICIES,
    "quantization": QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS,
    "speculative": SPECULATIVE_METHODS,
    "log_level": ("critical", "error", "warning", "info", "debug", "trace"),
    "replica_router": ROUTERS,
    "batch_order": BATCH_ORDERS,
    "responses_store": RESPONSE_STORES,
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


#: (group, dataclass, fields left out): the settings' owners.
_GROUPS = [
    ("launch", LaunchSettings, ()),
    ("engine", EngineConfig, ("image_limits",)),
    ("image", ImageLimits, ()),
    ("server", ServerSettings, ()),
    ("replicas", ReplicaSettings, ()),
]

#: ``--help`` sections by subject, in order: (title, flags). A flag not named here is
#: listed under "other" (a test keeps that section empty).
SUBJECTS: list[tuple[str, tuple[str, ...]]] = [
    (
        "model",
        (
            "model", "revision", "download_dir", "served_model_name", "device", "dtype",
            "quantization", "disable_int8_onednn", "tp", "tp_timeout_seconds",
        ),
    ),
    (
        "KV cache & tiers",
        (
            "page_size", "kv_cache_dtype", "max_total_tokens", "kv_cache_memory",
            "mem_fraction_static", "disable_radix_cache", "kv_host_bytes", "kv_disk_dir",
            "kv_disk_bytes", "kv_write_policy", "vision_cache_bytes",
        ),
    ),
    (
        "scheduling",
        (
            "max_running_requests", "max_prefill_tokens", "max_num_batched_tokens",
            "background_prefill_tokens", "disable_mixed_steps", "policy",
            "decode_reserve_ratio", "max_wait_seconds", "policy_seed", "dedup_min_tokens",
            "disable_jump_forward", "max_queued_requests", "retry_after_seconds",
        ),
    ),
    (
        "GPU/performance",
        (
            "attention_backend", "deterministic", "disable_cuda_graph", "cuda_graph_max_bs",
            "cuda_graph_twin",
        ),
    ),
    (
        "speculative decoding",
        (
            "speculative", "num_speculative_tokens", "ngram_min", "ngram_max",
            "speculative_max_batch", "speculative_min_accepted", "speculative_window",
        ),
    ),
    (
        "media limits (images/video)",
        (
            "max_image_tokens_per_request", "max_images_per_request",
            "max_request_image_pixels", "max_decoded_image_bytes",
            "decoded_image_wait_seconds", "max_image_bytes", "max_image_side",
            "max_image_pixels", "max_image_resized_side",
            "max_stored_images", "max_stored_image_bytes", "image_store_dir",
            "allow_remote_images",
            "allowed_local_media_path", "remote_image_timeout",
            "remote_image_max_redirects", "remote_image_allowed_networks",
            "max_video_bytes", "max_video_frames", "max_video_tokens", "max_video_side",
            "max_stored_videos", "max_stored_video_bytes",
            "max_streams", "stream_idle_seconds", "max_stream_frames_per_post",
            "max_stream_pixel_bytes",
        ),
    ),
    (
        "API & security",
        (
            "host", "port", "api_key", "api_keys", "shared_cache", "max_request_bytes",
            "max_json_depth",
            "max_questions", "max_n", "default_max_tokens", "stream_interval",
        ),
    ),
    (
        "batches (/v1/files, /v1/batches)",
        (
            "data_dir", "max_batch_file_bytes", "max_batch_lines", "max_stored_file_bytes",
            "batch_max_in_flight", "batch_in_flight_with_online", "batch_order",
        ),
    ),
    (
        "stored responses & conversations",
        (
            "responses_store", "max_stored_responses", "max_stored_response_bytes",
            "max_stored_object_bytes",
        ),
    ),
    ("replicas (Ray Serve)", ()),  # every ReplicaSettings field
    (
        "observability & process",
        (
            "log_level", "otlp_traces_endpoint", "unhealthy_after_failed_steps",
            "shutdown_grace_seconds", "fatal_exit_seconds", "engine_in_process",
            "engine_restarts", "engine_call_timeout",
        ),
    ),
]  # fmt: skip


def _subject(group: str, flag: str) -> str:
    """The ``--help`` section of ``flag`` (a flag name with underscores)."""
    if group == "replicas":
        return "replicas (Ray Serve)"
    for title, flags in SUBJECTS:
        if flag in flags:
            return title
    return "other"


def plain(text: str, flags: dict[str, str] | None = None) -> str:
    """``text`` without documentation markup, for ``--help``: ``x`` -> x,
    :func:`a.b.c` -> c, :data:`~a.B` -> B; a bare cross-reference in parentheses or after
    "see" (developer detail such as ``(:data:`POLICIES`)``) is dropped, and "None:"
    (an unset setting) reads "unset:".

    Args:
        text: a docstring fragment.
        flags: ``{field name: flag}``; ````field```` in ``text`` becomes its ``--flag``.
    """
    text = re.sub(r"\s*\(see :\w+:`[^`]*`\)|[:;,]\s*see :\w+:`[^`]*`", "", text)
    text = re.sub(r"\s*\(:\w+:`[^`]*`\)", "", text)
    text = re.sub(r":\w+:`~?([\w.]+)`", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    if flags:
        text = re.sub(
            r"``(\w+)``", lambda m: "--" + flags[m.group(1)] if m.group(1) in flags else m[0], text
        )
    text = re.sub(r"(^|\. )None: ", r"\1Unset: ", text)  # a sentence's first word
    text = re.sub(r"\bNone: ", "unset: ", text)
    return text.replace("``", "")


def _add_settings(p: argparse.ArgumentParser) -> None:
    sections = {title: p.add_argument_group(title) for title, _ in SUBJECTS}
    sections["other"] = p.add_argument_group("other")
    flags = {  # field name -> flag, for ``field`` in help texts
        f.name: _flag(group, f.name).replace("_", "-")
        for group, cls, _ in _GROUPS
        for f in dataclasses.fields(cls)
    }
    for group, cls, skip in _GROUPS:
        docs = _field_docs(cls)
        hints = typing.get_type_hints(cls)
        defaults = cls()
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = _flag(group, f.name)
            option = "--" + flag.replace("_", "-")
            default = getattr(defaults, f.name)
            kw: dict = {"dest": f"{group}.{f.name}", "default": default}
            text = plain(docs.get(f.name, ""), flags).replace("%", "%%")
            kw["help"] = text + " [default: %(default)s]"
            base = _base_type(hints[f.name])
            section = sections[_subject(group, flag)]
            if base is bool and default is False:
                # only --x in --help (no "--no-disable-..." double negative); --no-x
                # still parses, hidden, so existing command lines keep working
                kw["action"] = "store_true"
                section.add_argument(
                    "--no-" + option[2:],
                    dest=kw["dest"],
                    action="store_false",
                    default=default,
                    help=argparse.SUPPRESS,
                )
            elif base is bool:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = base
                kw["metavar"] = {int: "N", float: "X"}.get(base, flag.split("_")[-1].upper())
                if f.name in _CHOICES:  # listed in usage and help: {lpm,fcfs,...}
                    kw["choices"] = list(_CHOICES[f.name])
                    kw["metavar"] = "{" + ",".join(kw["choices"]) + "}"
            section.add_argument(option, **kw)


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
    for flag, value, least in (
        ("--shutdown-grace-seconds", launch.shutdown_grace_seconds, 0),
        ("--fatal-exit-seconds", launch.fatal_exit_seconds, 0),
        ("--engine-restarts", launch.engine_restarts, 0),
    ):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if launch.engine_call_timeout <= 0:
        raise ValueError(f"--engine-call-timeout must be > 0, got {launch.engine_call_timeout}")
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
    try:
        launch, config, server = settings_from_args(args)
        replicas = replica_settings_from_args(args)
    except ValueError as e:
        print(f"mmserve serve: error: {e}", file=sys.stderr)
        return 2
    # before torch is imported and the model loads (minutes for a 7B), not as uvicorn's
    # bare exit 3 after it
    busy = port_problem(launch.host, launch.port)
    if busy is not None:
        print(f"mmserve serve: error: {busy}", file=sys.stderr)
        return 2

    from mmserve.model.hub import HubModelError, resolve_config

    try:  # a Hub id becomes its local snapshot here, once, before any weight is read
        source = resolve_config(config)
    except HubModelError as e:
        print(f"mmserve serve: error: {e}", file=sys.stderr)
        return 2
    if source is not None and source.repo_id and not server.served_model_name:
        server.served_model_name = source.repo_id  # as vLLM: the id, not the commit folder

    import uvicorn

    from api.app import create_app, freeze_startup_objects, start_engine_process
    from mmserve.distributed.group import TPGroupError
    from mmserve.frontend.engine_client import EngineStartError
    from mmserve.frontend.frontend import Engine
    from mmserve.kernels.select import BackendUnavailableError, resolve_attention_backend
    from mmserve.testing.checkpoints import ensure_model

    if replicas.uses_ray:  # several engine replicas on Ray Serve (mmserve/fleet/)
        from api.replicas.launch import serve_replicas

        return serve_replicas(launch, config, server, replicas)
    config.model_path = config.model_path or str(ensure_model("tiny"))
    try:  # fail here, with the fix in the message, not inside the server's startup
        resolve_attention_backend(config.attention_backend, config.device, config.torch_dtype())
    except BackendUnavailableError as e:
        print(f"mmserve serve: error: {e}", file=sys.stderr)
        return 2
    front: Engine | FrontEnd
    process: EngineProcessClient | None = None
    try:  # a checkpoint it cannot load, a KV budget too small, a --tp it cannot split
        if launch.engine_in_process:
            front = Engine(config)
        else:  # the engine core in its own process (model, TP ranks, kernels there)
            front, process = start_engine_process(
                config, launch.engine_restarts, launch.log_level, launch.engine_call_timeout
            )
    except (ValueError, TPGroupError) as e:
        print(f"mmserve serve: error: {e}", file=sys.stderr)
        return 2
    except EngineStartError as e:
        print(f"mmserve serve: error: {e}", file=sys.stderr)
        return 2 if e.bad_setting else 1
    app = create_app(front, server, process=process)
    keys = app.state.tenant_keys
    if keys is not None and keys.path is not None:  # SIGHUP: read --api-keys again
        signal.signal(signal.SIGHUP, lambda *_: keys.reload())
    # the start-up lines print at --log-level from here on (uvicorn applies the same
    # configuration again); configured this late so that a refused start changes nothing
    logging.config.dictConfig(log_config(launch.log_level))
    log_startup(front, launch, server, process.info["describe"] if process else None)
    uv = uvicorn.Config(
        app,
        host=launch.host,
        port=launch.port,
        log_level=launch.log_level,
        log_config=log_config(launch.log_level),
        timeout_graceful_shutdown=launch.shutdown_grace_seconds,
    )
    # uvicorn handles SIGTERM/SIGINT: it stops accepting, waits up to the grace period
    # for running requests, then the app's shutdown aborts what is left. Afterwards it
    # re-raises the signal to the handler it found; a no-op one makes that exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    userver = uvicorn.Server(uv)
    freeze_startup_objects()  # full collections skip start-up's objects while serving
    watched = process if process is not None else front
    _exit_on_fatal(watched, userver, launch.fatal_exit_seconds)
    try:
        userver.run()
    finally:
        if process is not None:  # the app's shutdown stops it; a failed start did not
            process.stop()
    return 1 if watched.fatal_error() else 0


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (in use, not an address of this machine,
    no permission), else None; the socket is closed again at once.

    Bound like uvicorn binds (``SO_REUSEADDR``), so a port in TIME_WAIT is not refused.
    """
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot listen on --host {host} ({e.strerror})"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            why = "is in use" if e.errno == errno.EADDRINUSE else "cannot be bound"
            return (
                f"port {port} on {host} {why} ({e.strerror}); stop what listens there or "
                "pick another port with --port N"
            )
    return None


def log_config(level: str) -> dict:
    """uvicorn's logging configuration plus the ``api`` and ``mmserve`` loggers at
    ``level`` on uvicorn's stderr handler (without it their INFO lines, such as a
    request's ``user``, would go nowhere: the root logger has no handler)."""
    import uvicorn.config

    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    for name in ("api", "mmserve"):
        config["loggers"][name] = {
            "handlers": ["default"],
            "level": level.upper(),
            "propagate": False,
        }
    return config


def _exit_on_fatal(engine: Engine | EngineProcessClient, userver: object, delay: float) -> None:
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


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps help lines at spaces only, so ``--mem-fraction-static`` stays whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class _Parser(argparse.ArgumentParser):
    """Reports unknown arguments with the chosen subcommand's usage (argparse leaves them
    to the top-level parser, whose usage is only ``mmserve [-h] {serve,make-model}``),
    suggesting the closest flag for a typo."""

    def parse_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extra = self.parse_known_args(args, namespace)
        if not extra:
            return parsed
        sub = self._subparsers._group_actions[0].choices.get(getattr(parsed, "command", None))
        parser = sub or self
        msg = "unrecognized arguments: " + " ".join(extra)
        shown = [a for a in parser._actions if a.help != argparse.SUPPRESS]
        flags = [s for a in shown for s in a.option_strings]
        typo = next((a.split("=", 1)[0] for a in extra if a.startswith("--")), None)
        close = difflib.get_close_matches(typo, flags, n=1) if typo else []
        parser.error(msg + (f" (did you mean {close[0]}?)" if close else ""))


def build_parser() -> argparse.ArgumentParser:
    """The ``mmserve`` argument parser (also used by tests)."""
    from mmserve.cli import add_make_model_parser

    p = _Parser(prog="mmserve", description=plain(__doc__.splitlines()[0]))
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        help="run the HTTP server",
        formatter_class=_HelpFormatter,
        usage="mmserve serve [--model DIR] [--device cuda] [--port N] [options]",
        description="Run the OpenAI-compatible HTTP server (one engine, or --replicas N). "
        "Every option below has a default; the sections group them by subject.",
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
