"""The engine's counters and the figures built from them (metrics,
``/v1/cache/stats``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmserve.cache.kv_pool import kv_dtype_name
from mmserve.engine.request import Request
from mmserve.model.llama import token_embedding
from mmserve.model.weights_report import weight_bytes
from mmserve.vision.inputs import media_tokens

if TYPE_CHECKING:
    from mmserve.engine.engine import EngineCore
    from mmserve.engine.step import Chunks


@dataclass
class EngineStats:
    """Cumulative counters since start; token counts are of finished (or aborted) requests.

    Speculative decoding (:mod:`mmserve.engine.spec_decode`): ``spec_steps`` forwards
    that verified drafts; ``spec_verifies`` request-steps that did; ``spec_drafted_tokens``
    and ``spec_accepted_tokens`` tokens drafted and kept; ``spec_requests_off`` requests
    whose low acceptance turned speculation off; ``spec_batch_off_steps`` decode steps
    too large to speculate.
    """

    requests_finished: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_image_tokens: int = 0
    prompt_video_tokens: int = 0
    completion_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0
    failed_steps: int = 0
    consecutive_failed_steps: int = 0
    requests_failed: int = 0
    spec_steps: int = 0
    spec_verifies: int = 0
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_requests_off: int = 0
    spec_batch_off_steps: int = 0

    def count_finish(self, req: Request) -> None:
        """Count a finished (or aborted) request's tokens."""
        self.requests_finished += 1
        self.completion_tokens += len(req.output_ids)
        self.prompt_tokens += req.prompt_len
        image, video = media_tokens(req.input_ids, req.spans)
        self.prompt_image_tokens += image
        self.prompt_video_tokens += video
        self.cached_tokens += req.cached_len

    def count_step(self, decode: list[Request], chunks: Chunks, failed_before: int) -> None:
        """Count a step that gave logits (``failed_before``: ``failed_steps`` before it)."""
        if self.failed_steps == failed_before:
            self.consecutive_failed_steps = 0
        if chunks:
            self.prefill_steps += 1
        if decode:
            self.decode_steps += 1
        if decode and chunks:
            self.mixed_steps += 1


def cache_figures(engine: EngineCore) -> dict[str, float]:
    """Pool, tree and hit-rate figures of ``engine`` for metrics and ``/v1/cache/stats``:
    pages (``page_size`` tokens each), token counts, requests, seconds in the tree, and
    the KV tiers' own figures when they are on."""
    s = engine.stats
    P = engine.pool.page_size
    return {
        "page_size": P,
        "pool_pages": engine.pool.num_pages,
        "free_pages": engine.pool.allocator.num_free,
        "tree_pages": engine.tree.num_pages(),
        "evictable_pages": engine.tree.evictable_size() // P,
        # pages pinned against eviction: by live requests and held prefixes (streams)
        "locked_pages": engine.tree.protected_size() // P,
        "held_prefixes": len(engine.scheduler.holds),
        "tree_nodes": engine.tree.node_count(),
        # a request awaiting its jump-forward extend is running too
        "running_requests": len(engine.scheduler.running) + len(engine.scheduler.extending),
        "waiting_requests": len(engine.scheduler.waiting),
        "prompt_tokens": s.prompt_tokens,
        "prompt_image_tokens": s.prompt_image_tokens,
        "prompt_video_tokens": s.prompt_video_tokens,
        "cached_tokens": s.cached_tokens,
        "cache_hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
        "completion_tokens": s.completion_tokens,
        "requests_finished": s.requests_finished,
        "vision_tower_images": engine.runner.vision_tower_images,
        "vision_cache_hits": engine.embedding_cache.hits,
        "vision_cache_misses": engine.embedding_cache.misses,
        "tree_seconds": engine.scheduler.tree_seconds,
        "retractions": engine.scheduler.retractions,
        "failed_steps": s.failed_steps,
        "consecutive_failed_steps": s.consecutive_failed_steps,
        "requests_failed": s.requests_failed,
        "spec_drafted_tokens": s.spec_drafted_tokens,
        "spec_accepted_tokens": s.spec_accepted_tokens,
        "spec_verifies": s.spec_verifies,
        "spec_steps": s.spec_steps,
        "spec_requests_off": s.spec_requests_off,
        "spec_batch_off_steps": s.spec_batch_off_steps,
        # tokens each verify gave (kept drafts plus the one the target always gives)
        "spec_accepted_length": (
            1 + s.spec_accepted_tokens / s.spec_verifies if s.spec_verifies else 0.0
        ),
        **(engine.tiers.stats() if engine.tiers is not None else {}),
    }


def engine_summary(engine: EngineCore) -> dict:
    """What ``engine`` runs, for ``mmserve serve``'s start-up summary.

    Returns:
        ``family``; ``parameters`` (decoder + vision, on this rank); ``dtype`` (the
        model's) and ``kv_dtype`` (torch dtype names); ``pool_pages``, ``page_size``,
        ``pool_tokens``, ``pool_bytes`` (K and V buffers, bytes); ``bytes_per_token``
        and ``pool_sized_by`` (None for a pool not sized by ``for_model``);
        ``kv_scales`` (where the fp8 KV scales come from and their range, in words);
        ``quantization`` (the decoder weights' method), ``weight_bytes`` (parameters
        and buffers, bytes) and ``weights`` (both and the LM head, in words);
        ``attention_backend``; ``decode`` (CUDA graphs or eager, and why).
    """
    model, pool = engine.model, engine.pool
    modules = [m for m in (model.decoder, model.vision) if hasattr(m, "parameters")]
    plan = pool.plan
    return {
        "family": model.family.name,
        "parameters": sum(p.numel() for m in modules for p in m.parameters()),
        "dtype": str(token_embedding(model.decoder).weight.dtype).removeprefix("torch."),
        "kv_dtype": kv_dtype_name(pool.dtype),
        "pool_pages": pool.num_pages,
        "page_size": pool.page_size,
        "pool_tokens": pool.size_tokens,
        "pool_bytes": sum(b.numel() * b.element_size() for b in pool.k_buffers + pool.v_buffers),
        "bytes_per_token": plan.bytes_per_token if plan else None,
        "pool_sized_by": plan.reason if plan else None,
        "kv_scales": engine.kv_scales.source,
        "quantization": model.quantization,
        "weight_bytes": weight_bytes(model),
        "weights": engine.weights_summary,
        "attention_backend": engine.runner.backend.name,
        "decode": engine.decode_mode,
    }
