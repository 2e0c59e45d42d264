"""What ``mmserve serve`` logs once its engine is built (:func:`startup_summary`):
model, weights, KV pool and scales, backend, tiers, URL."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from api.settings import ServerSettings

if TYPE_CHECKING:
    from api.cli import LaunchSettings
    from mmserve.frontend.frontend import Engine, FrontEnd

log = logging.getLogger("api.cli")

__all__ = ["log_startup", "startup_summary"]


def startup_summary(
    engine: Engine | FrontEnd,
    launch: LaunchSettings,
    server: ServerSettings,
    described: dict | None = None,
) -> list[str]:
    """The lines ``mmserve serve`` logs once the engine is built: the model (family,
    parameters, dtype and why), its weights (quantization, bytes, the LM head), the KV
    pool (pages, tokens, bytes, where the size came from), the KV scales (where from and
    their range), the attention backend and decode mode, the KV tiers, the URL, and a
    note when the chat template renders media after text
    (:meth:`~mmserve.frontend.prompt.PromptBuilder.renders_media_after_text`).
    ``described``: what the engine process said it runs (``engine`` is then its front
    end), else ``engine.describe()``."""
    from pathlib import Path

    from mmserve.config import auto_dtype
    from mmserve.model.hub import source_of

    cfg = engine.config
    if described is not None:
        d = described
    else:  # an in-process Engine (a front end alone comes with its description)
        d = engine.describe()  # type: ignore[union-attr]
    why = f"--dtype auto: {auto_dtype(cfg.device)[1]}" if cfg.dtype == "auto" else "--dtype"
    tp = f", tensor-parallel over {cfg.tp} ranks" if cfg.tp > 1 else ""
    name = server.served_model_name or Path(cfg.model_path or "mmserve").name
    lines = [
        f"model {name}: {d['family']} family, {d['parameters'] / 1e6:,.1f} M parameters "
        f"(decoder + vision), dtype {d['dtype']} ({why}), on {cfg.device}{tp}; "
        f"from {source_of(cfg.model_path)}; weights: {d['weights']}"
    ]
    sized = (
        f" ({d['bytes_per_token']:,} bytes per token), sized by {d['pool_sized_by']}"
        if d["pool_sized_by"]
        else ""
    )
    lines.append(
        f"KV pool: {d['pool_pages']:,} pages x {d['page_size']} tokens = "
        f"{d['pool_tokens']:,} tokens, {d['pool_bytes'] / 2**20:,.1f} MiB of {d['kv_dtype']}"
        + sized
        + f"; KV scales: {d['kv_scales']}"
    )
    lines.append(f"attention backend: {d['attention_backend']}; decode: {d['decode']}")
    tiers = []
    if cfg.kv_host_bytes:
        tiers.append(f"host memory {cfg.kv_host_bytes / 2**30:.2f} GiB (--kv-host-bytes)")
    if cfg.kv_disk_dir:
        tiers.append(f"disk {cfg.kv_disk_dir}, at most {cfg.kv_disk_bytes / 2**30:.2f} GiB")
    lines.append(
        "KV tiers: pool, then " + ", then ".join(tiers)
        if tiers
        else "KV tiers: the pool only (evicted pages are dropped; --kv-host-bytes and "
        "--kv-disk-dir add tiers)"
    )
    host = f"[{launch.host}]" if ":" in launch.host else launch.host
    url = f"http://{host}:{launch.port}"
    lines.append(
        f"serving {name!r} at {url}/v1 (OpenAI API), web page {url}/, metrics {url}/metrics"
    )
    if engine.processor.prompts.renders_media_after_text():
        lines.append(
            "chat template: renders a message's parts in order, so media after text stays "
            "after it: part order matters, and requests that put different text before the "
            "same image share only the prefix before that text (put images first to reuse "
            "them; docs/api.md, 'Part order and the prefix cache')"
        )
    return lines


def log_startup(
    engine: Engine | FrontEnd,
    launch: LaunchSettings,
    server: ServerSettings,
    described: dict | None = None,
) -> None:
    """Log :func:`startup_summary`'s lines at INFO on the ``api.cli`` logger."""
    for line in startup_summary(engine, launch, server, described):
        log.info("%s", line)
