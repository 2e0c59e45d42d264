"""The engine: continuous batching over a shared paged KV pool and radix cache.

Each :meth:`Engine.step` either prefills a batch of newly admitted requests or
decodes one token for every running request (prefill first, as in SGLang and
vLLM's default). The engine is single-threaded; :mod:`mmserve.engine.async_engine`
drives it from a background thread for the HTTP server.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmserve.cache.kv_pool import KVPool
from mmserve.cache.radix_cache import RadixCache
from mmserve.config import EngineConfig
from mmserve.engine.model_runner import ModelRunner
from mmserve.engine.prompt import PromptBuilder, PromptError
from mmserve.engine.request import GenerateResult, ImageInput, Request, SamplingParams
from mmserve.engine.sampling import make_generator, sample_token, token_logprob
from mmserve.engine.scheduler import Scheduler
from mmserve.model.loader import LoadedModel, load_model
from mmserve.vision.embedding_cache import EmbeddingCache
from mmserve.vision.hashing import image_key, processor_fingerprint
from mmserve.vision.image import decode_image


class RequestError(ValueError):
    """A request the engine refuses; the message says why (HTTP 400).

    Args:
        message: what is wrong, in words for the client.
        param: the request field at fault ("messages", "max_tokens", ...), if known.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class EngineStats:
    """Cumulative counters since start; token counts are of finished (or aborted) requests."""

    requests_finished: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0


class Engine:
    """Offline and step-wise generation with LLaVA on a paged KV pool.

    Args:
        config: engine settings; ``config.model_path`` names the checkpoint.
        model: an already loaded model (skips loading; for tests).

    Raises:
        ValueError: for invalid settings; CheckpointError for a bad checkpoint.
    """

    def __init__(self, config: EngineConfig, model: LoadedModel | None = None) -> None:
        config.validate()
        self.config = config
        if model is None:
            if config.model_path is None:
                from mmserve.model.make_checkpoint import ensure_model

                config.model_path = str(ensure_model("tiny"))
            model = load_model(config.model_path, device=config.device, dtype=config.torch_dtype())
        self.model = model
        shape = model.decoder.shape
        self.max_context = shape.max_position_embeddings
        num_pages = config.max_total_tokens // config.page_size
        self.pool = KVPool(
            num_pages,
            config.page_size,
            shape.num_layers,
            shape.num_kv_heads,
            shape.head_dim,
            dtype=model.decoder.embed_tokens.weight.dtype,
            device=config.device,
        )
        self.tree = RadixCache(
            config.page_size, self.pool.allocator.free, disable=config.disable_radix_cache
        )
        self.scheduler = Scheduler(config, self.pool, self.tree)
        self.embedding_cache = EmbeddingCache(config.vision_cache_size)
        self.runner = ModelRunner(
            model, self.pool, self.embedding_cache, config.device, config.attention_backend
        )
        self.prompts = PromptBuilder(model, config.max_images_per_request)
        self.fingerprint = processor_fingerprint(model.processor.image_processor)
        self.shortest_edge = _shortest_edge(model.processor.image_processor)
        self.stats = EngineStats()
        self._by_rid: dict[str, Request] = {}

    # ---- inputs -----------------------------------------------------------
    def prepare_image(self, data: bytes) -> ImageInput:
        """Decode and hash an encoded image (no preprocessing).

        Raises:
            ImageError: for empty, corrupt, over-size or degenerate images.
        """
        im = decode_image(data, self.config.image_limits, self.shortest_edge)
        return ImageInput(image_key(im, self.fingerprint), im)

    def make_request(
        self,
        *,
        messages: Sequence[dict] | None = None,
        prompt: str | None = None,
        images: Sequence[ImageInput] = (),
        params: SamplingParams | None = None,
        rid: str | None = None,
    ) -> Request:
        """Build a validated request from chat ``messages`` or a raw ``prompt``.

        Raises:
            RequestError: bad sampling parameters, placeholder/image mismatch, or a
                prompt plus ``max_tokens`` beyond the context or the KV pool.
        """
        params = params or SamplingParams()
        try:
            params.validate()
            if (messages is None) == (prompt is None):
                raise RequestError("give exactly one of messages or prompt")
            if messages is not None:
                ids, spans = self.prompts.from_messages(messages, list(images))
            else:
                ids, spans = self.prompts.from_text(prompt, list(images))
        except PromptError as e:
            raise RequestError(str(e)) from None
        except RequestError:
            raise
        except ValueError as e:
            raise RequestError(str(e)) from None
        self.check_length(len(ids), params.max_tokens)
        req = Request(ids, spans, params, rid=rid)
        req.generator = make_generator(params, self.config.device)
        return req

    def check_length(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse a prompt that leaves no room for output, or ``max_tokens`` beyond the room.

        A prompt that alone fills the context or the KV pool is blamed on the prompt
        ("messages"), never on ``max_tokens``.

        Raises:
            RequestError: with ``param`` "messages" or "max_tokens".
        """
        for limit, what in (
            (self.max_context, "the model's context"),
            (self.pool.size_tokens, "the KV pool"),
        ):
            if prompt_len >= limit:
                raise RequestError(
                    f"prompt is {prompt_len} tokens; {what} holds {limit} tokens, which leaves "
                    f"no room for output: shorten the messages or send fewer images",
                    param="messages",
                )
            if prompt_len + max_tokens > limit:
                raise RequestError(
                    f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) is "
                    f"{prompt_len + max_tokens} tokens; {what} holds {limit} tokens: set "
                    f"max_tokens to at most {limit - prompt_len}",
                    param="max_tokens",
                )

    def add_request(self, req: Request) -> None:
        """Queue a request built by :meth:`make_request`."""
        self._by_rid[req.rid] = req
        self.scheduler.add(req)

    def abort(self, rid: str) -> bool:
        """Stop a request; its computed KV goes to the tree and its pages are freed.

        Returns:
            True if the request was found waiting or running.
        """
        req = self._by_rid.pop(rid, None)
        if req is None or req.finished:
            return False
        if req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
        else:
            self.scheduler.release(req)
        self._finish(req, "abort")
        return True

    def live_requests(self) -> list[Request]:
        """Every request added and not yet finished (waiting, running or mid-step)."""
        return list(self._by_rid.values())

    # ---- stepping ---------------------------------------------------------
    def has_work(self) -> bool:
        """Whether any request waits, runs or sits between prefill chunks."""
        return self.scheduler.has_work()

    def step(self) -> list[Request]:
        """Run one prefill or decode batch.

        Returns:
            Requests that got a token this step (finished ones included).
        """
        sched = self.scheduler
        chunks = sched.schedule_prefill()
        if chunks:
            logits = self.runner.prefill([r for r, _ in chunks], [n for _, n in chunks])
            self.stats.prefill_steps += 1
            batch, rows = [], []
            for (req, n), row in zip(chunks, logits, strict=True):
                req.computed_len += n
                sched.on_prefilled(req)
                if req.computed_len < len(req.all_ids()):
                    continue  # more chunks to come; these logits are not a next token
                if sched.prefilling is req:
                    sched.prefilling = None
                sched.running.append(req)
                batch.append(req)
                rows.append(row)
        elif sched.running:
            sched.prepare_decode()
            batch = list(sched.running)
            rows = self.runner.decode(batch)
            self.stats.decode_steps += 1
            for req in batch:
                req.computed_len += 1
        else:
            return []
        now = time.perf_counter()
        for req, row in zip(batch, rows, strict=True):
            self._append_token(req, row, now)
        return batch

    def _append_token(self, req: Request, logits: torch.Tensor, now: float) -> None:
        if req.logits is not None:
            req.logits.append(logits.detach().cpu().clone())
        tok = sample_token(logits, req.params, req.generator)
        if req.logprobs is not None:
            req.logprobs.append(token_logprob(logits, tok, req.params.logprobs))
        req.output_ids.append(tok)
        if req.first_token_time is None:
            req.first_token_time = now
        p = req.params
        reason = None
        if tok in self.model.eos_token_ids and not p.ignore_eos:
            reason = "stop"
        text = self.model.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        cut = first_stop(text, p.stop)
        if cut is not None:
            text, reason = text[:cut], "stop"
        req.text = text
        if reason is None and len(req.output_ids) >= p.max_tokens:
            reason = "length"
        if reason is not None:
            self.scheduler.release(req)
            self._finish(req, reason)
        elif req.on_update is not None:
            req.on_update(req)

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        self._by_rid.pop(req.rid, None)
        self.stats.requests_finished += 1
        self.stats.completion_tokens += len(req.output_ids)
        self.stats.prompt_tokens += req.prompt_len
        self.stats.cached_tokens += req.cached_len
        if req.on_update is not None:
            req.on_update(req)

    # ---- offline API ------------------------------------------------------
    def generate(self, requests: Sequence[Request]) -> list[GenerateResult]:
        """Run ``requests`` to completion together (continuous batching).

        Returns:
            One :class:`GenerateResult` per request, in input order.

        Raises:
            RuntimeError: if the engine runs out of work with a request unfinished
                (a scheduler bug; never a silent unfinished result).
        """
        for req in requests:
            self.add_request(req)
        while any(not r.finished for r in requests):
            if not self.has_work():
                stuck = [r.rid for r in requests if not r.finished]
                raise RuntimeError(f"engine idle with unfinished requests {stuck}")
            self.step()
        return [r.result() for r in requests]

    def cache_stats(self) -> dict[str, float]:
        """Pool, tree and hit-rate figures for metrics and ``/v1/cache/stats``."""
        s = self.stats
        P = self.pool.page_size
        tree_pages = self.tree.num_pages() if not self.tree.disable else 0
        return {
            "page_size": P,
            "pool_pages": self.pool.num_pages,
            "free_pages": self.pool.allocator.num_free,
            "tree_pages": tree_pages,
            "evictable_pages": self.tree.evictable_size() // P if not self.tree.disable else 0,
            "tree_nodes": self.tree.node_count() if not self.tree.disable else 0,
            "running_requests": len(self.scheduler.running),
            "waiting_requests": len(self.scheduler.waiting),
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,
            "cache_hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            "completion_tokens": s.completion_tokens,
            "requests_finished": s.requests_finished,
            "vision_tower_images": self.runner.vision_tower_images,
            "vision_cache_hits": self.embedding_cache.hits,
            "vision_cache_misses": self.embedding_cache.misses,
            "tree_seconds": self.scheduler.tree_seconds,
            "retractions": self.scheduler.retractions,
        }


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where ``text`` must end: the start of the earliest occurrence of any stop string.

    The list order does not matter (OpenAI's behaviour); ties start at one position.

    Returns:
        The character index to cut at, or None when no stop string occurs.
    """
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _shortest_edge(image_processor: object) -> int:
    size = getattr(image_processor, "size", None) or {}
    if isinstance(size, dict):
        return int(
            size.get("shortest_edge") or min(size.get("height", 336), size.get("width", 336))
        )
    return int(getattr(size, "shortest_edge", None) or 336)
