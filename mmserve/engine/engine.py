"""The engine core: continuous batching over a shared paged KV pool and radix cache.

Each :meth:`EngineCore.step` decodes one token for every running request and, in
the rest of the step's token budget, prefills chunks of waiting requests (a
mixed step, as vLLM's chunked prefill), so a long prompt never stalls the
running streams for longer than one chunk. The engine is single-threaded and takes
:class:`~mmserve.types.EngineRequest` messages in, hands :class:`~mmserve.types.TokenDelta`
messages out; it never imports the front end (:mod:`mmserve.frontend`: processor, text,
the offline ``Engine`` and the thread that drives it for the HTTP server).
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from collections.abc import Callable

import torch

from mmserve.cache.kv_pool import KVPool, fp8_kv_unavailable, kv_dtype_name
from mmserve.cache.no_prefix_cache import PrefixCache
from mmserve.cache.salt import namespace
from mmserve.config import EngineConfig
from mmserve.engine.cuda_graph import graph_mode
from mmserve.engine.model_runner import ModelRunner
from mmserve.engine.request import Request
from mmserve.engine.sampling import (
    LogitsProcessors,
    batch_logprobs,
    make_generator,
    sample_batch,
    sample_token,
    token_logprob,
)
from mmserve.engine.scheduler import Scheduler, make_kv_tiers, make_tree, needs_extend
from mmserve.engine.scheduler.features import FeatureLoads
from mmserve.engine.spec_decode import make_speculator
from mmserve.engine.stats import EngineStats, cache_figures, engine_summary
from mmserve.engine.step import (
    Chunks,
    logit_rows,
    record_vision,
    run_mixed,
    schedule_step,
    token_delta,
)
from mmserve.kernels.warmup import KernelShape, kernel_steps, warm_up_kernels
from mmserve.model import quant_onednn
from mmserve.model.hub import resolve_config
from mmserve.model.kv_scales import kv_scale_plan
from mmserve.model.llama import token_embedding
from mmserve.model.loader import LoadedModel, load_model
from mmserve.model.quant import check_quantization, kv_cache_scheme
from mmserve.model.weights_report import weights_summary
from mmserve.structured.compile import GrammarCache, new_state
from mmserve.structured.decode import GuidedDecoding
from mmserve.types import EngineRequest, TokenDelta, TokenLogprob
from mmserve.vision.embedding_cache import EmbeddingCache

log = logging.getLogger(__name__)

__all__ = ["EngineCore", "EngineStats"]


class EngineCore:
    """Step-wise generation with LLaVA on a paged KV pool: request messages in, token
    deltas out (the front end's :class:`~mmserve.frontend.frontend.Engine` adds the
    input processor and text).

    Args:
        config: engine settings; ``config.model_path`` names the checkpoint, a directory
            or a Hub id (resolved to its local snapshot here, in place:
            :func:`~mmserve.model.hub.resolve_config`; required unless ``model`` is given).
        model: an already loaded model (skips loading; for tests).

    Raises:
        ValueError: for invalid settings or neither a model path nor a model;
            CheckpointError for a bad checkpoint; HubModelError (a ValueError) for a Hub
            id that does not resolve.
    """

    def __init__(self, config: EngineConfig, model: LoadedModel | None = None) -> None:
        config.validate()
        self.config = config
        if model is None:
            if config.model_path is None:  # the CLI supplies its bundled default model
                raise ValueError("no model: set EngineConfig.model_path or pass a loaded model")
            resolve_config(config)  # a Hub id: its snapshot (no-op for a directory)
            check_quantization(config.quantization, config.device)  # before the load
            quant_onednn.enable(
                not config.disable_int8_onednn
            )  # int8's prepacked copies, made at load
            if config.tp > 1:  # rank 0 of a tensor-parallel group; starts the other ranks
                from mmserve.distributed.group import load_tp_model

                model = load_tp_model(config)
            else:
                model = load_model(
                    config.model_path,
                    device=config.device,
                    dtype=config.torch_dtype(),
                    quantization=config.quantization,
                )
        elif config.tp > 1:
            raise ValueError("tp > 1 loads its own shards: pass no model")
        check_quantization(model.quantization, config.device)  # a checkpoint's own method
        self.model = model
        shape = model.decoder.shape
        self.max_context = shape.max_position_embeddings
        #: fp8 KV or not, and the checkpoint's per-layer scales (where from, said in words)
        self.kv_scales = kv_scale_plan(
            config.kv_cache_dtype,
            config.model_path,
            shape.num_layers,
            kv_cache_scheme(getattr(model.config, "quantization_config", None)),
            fp8_unavailable=fp8_kv_unavailable(config),
        )
        log.log(self.kv_scales.level, "KV scales: %s", self.kv_scales.source)
        dtype = token_embedding(model.decoder).weight.dtype
        self.pool = KVPool.for_model(
            config, shape, dtype, self.kv_scales.scales, fp8=self.kv_scales.fp8
        )
        #: the weights in words (quantization, bytes, the LM head), for the start-up summary
        self.weights_summary = weights_summary(model)
        log.info("weights: %s", self.weights_summary)
        self.embedding_cache = EmbeddingCache(config.vision_cache_bytes)
        # host/disk KV tiers behind the tree (None when off): see mmserve.cache.kv_tiers;
        # image features read from the disk tier go into the embedding cache
        self.tiers = make_kv_tiers(config, model, self.pool, self.embedding_cache)
        self.tree: PrefixCache = make_tree(config, self.pool, self.tiers)
        self.scheduler = Scheduler(config, self.pool, self.tree, self.tiers)
        self.runner = ModelRunner(
            model,
            self.pool,
            self.embedding_cache,
            config.device,
            config.attention_backend,
            tiers=self.tiers,
            deterministic=config.deterministic,
        )
        bind = getattr(model.decoder, "bind", None)
        if bind is not None:  # tensor parallel: broadcasts each batch's plan
            bind(self.runner)
        max_bs, capture, why = graph_mode(config, self.runner.backend)
        if max_bs:  # after the pool: graphs capture over its buffers
            self.runner.enable_graphs(max_bs, capture)
        #: how decode runs, for the start-up summary of ``mmserve serve``
        self.decode_mode = (
            f"CUDA-graph buckets up to {max_bs}, {why}" if max_bs else f"eager ({why})"
        )
        log.info("decode: %s", self.decode_mode)
        #: compiled structured-output grammars, shared with the front end's processor
        #: (which compiles them on callers' threads); the engine makes each matcher
        self.grammars = GrammarCache(model)
        self.guided = GuidedDecoding(
            model, self.grammars, jump_forward=not config.disable_jump_forward
        )
        self.processors = LogitsProcessors(shape.vocab_size, model.eos_token_ids, config.device)
        self.stats = EngineStats()
        #: n-gram speculative decoding (None: off; see mmserve.engine.spec_decode)
        self.speculator = make_speculator(config, shape.vocab_size)
        self._eos = frozenset(model.eos_token_ids)  # the per-token end check
        self._stop_hits: list[str] = []  # requests the front end saw hit a stop string
        self._closed = False
        #: where each step's deltas go, all requests' in one call (the async engine's and
        #: the engine process's output path); None: only each request's ``on_update``
        self.on_outputs: Callable[[list[TokenDelta]], None] | None = None
        self._outbox: list[tuple[Request, TokenDelta]] = []

    def set_feature_source(self, source) -> None:
        """Ask ``source`` for the features of items the embedding cache misses before the
        vision tower runs here: called with the items, returns one ``[tokens,
        text_hidden]`` tensor or None per item (None for an item: the tower runs here).
        ``source`` None: always the tower.

        ``source`` may block (a remote fetch): it runs on a worker thread while the
        request waits "loading" (:class:`~mmserve.engine.scheduler.features.FeatureLoads`),
        never inside a step, so other requests keep decoding."""
        if self.scheduler.features is not None:
            self.scheduler.features.close()
        if source is None:
            self.scheduler.features = self.runner.feature_source = None
            return
        loads = FeatureLoads(source, self.embedding_cache.__contains__)
        self.scheduler.features = loads
        self.runner.feature_source = loads  # what the loads fetched; never waits

    @property
    def remote_feature_images(self) -> int:
        """Items whose features the feature source gave (no tower run here)."""
        return self.runner.remote_feature_images

    def describe(self) -> dict:
        """What this engine runs, for ``mmserve serve``'s start-up summary
        (:func:`~mmserve.engine.stats.engine_summary`)."""
        return engine_summary(self)

    def warm_up_kernels(self) -> list[tuple[str, float]]:
        """Build or load every GPU kernel module this engine's model runs (FlashInfer's
        prefill/decode for its heads and dtypes, the fused norm/RoPE/SiLU ops), one log
        line per module with its time, so that no request waits for a JIT compile on a
        fresh host (see :mod:`mmserve.kernels.warmup`). Nothing to do off CUDA or with
        the torch attention backend (which runs the torch fused ops too).

        Returns:
            ``[(module, seconds)]``.

        Raises:
            RuntimeError: a module failed to build or run.
        """
        shape, backend = self.model.decoder.shape, self.runner.backend
        kshape = KernelShape(
            getattr(backend, "num_qo_heads", shape.num_heads),
            getattr(backend, "num_kv_heads", shape.num_kv_heads),
            shape.head_dim,
            self.runner.dtype,
            self.pool.dtype,
        )
        if self.runner.device.type != "cuda" or backend.name != "flashinfer":
            return []  # the torch backend and torch fused ops: nothing to build
        steps = kernel_steps(kshape, self.runner.device, backend.name)
        return warm_up_kernels(steps, log)

    def fatal_error(self) -> str | None:
        """Why this engine can serve nothing any more (a tensor-parallel rank died or
        hung), else None."""
        return getattr(self.model.decoder, "failure", None)

    def add_request(
        self, msg: EngineRequest, on_update: Callable[[TokenDelta], None] | None = None
    ) -> None:
        """Queue a request message built by the front end's
        :class:`~mmserve.frontend.processor.InputProcessor`; its progress goes to
        ``on_update`` as :class:`TokenDelta` messages (on this thread, after each step),
        and to :attr:`on_outputs` with every other request's when that is set."""
        req = self.request_state(msg)
        req.on_update = on_update
        self.scheduler.add(req)

    def request_state(self, msg: EngineRequest) -> Request:
        """The engine's private state for ``msg`` (not queued; :meth:`add_request` queues
        it): token lists, the grammar matcher, the sampling generator."""
        req = Request(list(msg.input_ids), list(msg.spans), msg.params, rid=msg.rid)
        req.arrival, req.priority = msg.arrival, msg.priority
        req.cache_ns = namespace(msg.cache_salt)
        always = self.config.kv_write_policy == "write_through"
        req.write_through = always or msg.prompt_cache_retention == "24h"
        req.hold = msg.hold
        if msg.grammar is not None:
            assert msg.params.guided is not None  # the grammar is compiled from it
            req.grammar = new_state(msg.grammar, msg.params.guided)
        req.generator = make_generator(msg.params, self.config.device)
        return req

    def abort(self, rid: str) -> bool:
        """Stop a request (its computed KV to the tree, its pages freed); True if it was
        found waiting or running."""
        found = self._abort(rid)
        self.flush_outputs()
        return found

    def _abort(self, rid: str) -> bool:
        req = self.scheduler.get(rid)
        if req is None or req.finished:
            return False
        self.scheduler.abort(req)
        self._finish(req, "abort")
        return True

    def abort_all(self, reason: str = "abort", error: str | None = None) -> list[Request]:
        """End every live request (pages back to the pool); returns them."""
        reqs = self.scheduler.abort_all()
        for req in reqs:
            req.error = error
            self._finish(req, reason)
        self.flush_outputs()
        return reqs

    def flush_cache(self) -> int:
        """Drop the prefix cache (held prefixes included) and the vision-embedding cache;
        returns pages freed. Raises RuntimeError while any request is live."""
        if self.scheduler.live or self.has_work():
            raise RuntimeError("requests are live")
        freed = self.scheduler.flush_cache()
        self.embedding_cache.clear()
        if self.tiers is not None:
            self.tiers.clear_memory()  # the disk tier, shared with other processes, stays
        return freed

    def close(self, timeout: float = 60.0) -> int:
        """Shutdown: write every cached page to the disk KV tier (if on), stop the tiers'
        threads (seconds: at most about ``timeout``) and the tensor-parallel worker
        processes (if any). Call when the engine no longer steps.

        Returns:
            Pages written (0 on a second call: closing twice is a no-op).
        """
        if self._closed:
            return 0
        self._closed = True
        if self.scheduler.features is not None:
            self.scheduler.features.close()
        written = 0
        if self.tiers is not None:
            written = self.scheduler.flush_tiers(timeout)
            self.tiers.close(timeout)
        close = getattr(self.model.decoder, "close", None)
        if close is not None:
            close()
        return written

    def stats_snapshot(self) -> dict:
        """:meth:`cache_stats` plus used pages, the KV pool's dtype (``kv_cache_dtype``:
        "fp8_e4m3" or the model dtype's name) and bytes per token, live requests and, when
        no request is live, the pool accounting check (``{"ok": bool, ...}``; None while busy)."""
        cache = self.cache_stats()
        stats: dict[str, object] = dict(cache)
        # used: held by requests, so used + evictable + free = pool (disjoint states)
        stats["used_pages"] = cache["pool_pages"] - cache["free_pages"] - cache["evictable_pages"]
        stats["kv_cache_dtype"] = kv_dtype_name(self.pool.dtype)
        stats["kv_bytes_per_token"] = self.pool.bytes_per_token()
        stats["live_requests"] = len(self.live_requests())
        stats["accounting"] = None
        if not self.live_requests() and not self.has_work():
            try:
                stats["accounting"] = {"ok": True, **self.check_accounting()}
            except AssertionError as e:
                stats["accounting"] = {"ok": False, "error": str(e)}
        return stats

    def check_accounting(self) -> dict[str, int]:
        """The scheduler's pool accounting check (see :meth:`Scheduler.check_accounting`)."""
        return self.scheduler.check_accounting()

    def live_requests(self) -> list[Request]:
        """Every request added and not yet finished (waiting, running or mid-step)."""
        return list(self.scheduler.live.values())

    # ---- stepping ---------------------------------------------------------
    def has_work(self) -> bool:
        """Whether any request waits, runs or sits between prefill chunks."""
        return self.scheduler.has_work()

    def step(self) -> list[Request]:
        """Run one batch: a mixed step by default, else a prefill or a decode batch
        (:func:`~mmserve.engine.step.schedule_step`): schedule, forward, sample, update.

        An exception while running the batch fails only that batch's requests
        (finish reason "error", pages freed, traceback logged); the engine keeps
        serving the rest. ``stats.consecutive_failed_steps`` counts failures in a row.

        Returns:
            Requests that got a token this step (finished ones included).
        """
        try:
            return self._step()
        finally:  # one batch of every request's deltas per step (failed ones included)
            self.flush_outputs()

    def _step(self) -> list[Request]:
        self._abort_stopped()
        decode, chunks = schedule_step(self.scheduler, self.config)
        if not chunks and not decode:
            return []
        if self.speculator is not None:  # drafts verified in this step's forward
            done = self.speculator.step(self, decode, chunks)
            if done is not None:
                return done
        logits = self._forward(decode, chunks)
        if logits is None:
            return []
        batch, rows = logit_rows(self.scheduler, decode, chunks, logits)
        if batch:
            assert rows is not None  # logit_rows gives rows with every non-empty batch
            self._sample_and_update(batch, self._processed(batch, rows))
        return batch

    def _forward(self, decode: list[Request], chunks: Chunks) -> torch.Tensor | None:
        """The step's logits ``[len(decode) + len(chunks), vocab]`` (None if it all
        failed), with the vision counts and the step counters recorded."""
        failed_before = self.stats.failed_steps
        logits = run_mixed(self.runner, decode, chunks, self._run_batch)
        record_vision(self.runner, chunks)  # the step writes requests, the runner only counts
        if logits is not None:
            self.stats.count_step(decode, chunks, failed_before)
        return logits

    def _processed(self, batch: list[Request], rows: torch.Tensor) -> torch.Tensor:
        """``rows`` ``[len(batch), vocab]`` after logit_bias and penalties, then the
        grammar masks, then min_tokens (which yields to a grammar that allows only end of
        sequence): see :mod:`mmserve.engine.sampling`."""
        out = self.processors.apply(batch, rows)
        out = self.guided.apply_masks(batch, out)
        out = self.processors.apply_min_tokens(batch, out)
        if not isinstance(out, torch.Tensor):
            out = torch.stack(list(out))
        return out

    def _sample_and_update(self, batch: list[Request], rows: torch.Tensor) -> None:
        """Sample each request's token from its row of ``rows`` (``[len(batch), vocab]``)
        and append it: the whole batch at once (one host-device sync), row by row when
        that raises; a row whose sampling or bookkeeping raises fails only its request."""
        now = time.perf_counter()
        sampled: tuple[list[int], list[TokenLogprob | None]] | None  # tokens, logprobs
        try:
            tokens = sample_batch(rows, [r.params for r in batch], [r.generator for r in batch])
            sampled = tokens, batch_logprobs(rows, tokens, [r.params.logprobs for r in batch])
        except Exception:  # noqa: BLE001 - row by row below, failing only the bad row
            sampled = None
        if sampled is not None:
            self._update_batch(batch, rows, sampled[0], sampled[1], now)
            return
        for i, req in enumerate(batch):
            try:
                tok, lp = self._sample_row(req, rows[i])
                self._append_token(req, rows[i], tok, lp, now)
            except Exception:  # noqa: BLE001 - sampling or its bookkeeping failed for this one
                self._fail([req], "while sampling its next token")

    def _update_batch(
        self,
        batch: list[Request],
        rows: torch.Tensor,
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
        now: float,
    ) -> None:
        """Append a whole batch's sampled ``tokens`` and check each request's end in one
        pass: a request without a grammar or kept logits takes the short path (append,
        EOS, ``max_tokens``), the others :meth:`_append_token`; a request whose
        bookkeeping raises fails alone."""
        eos = self._eos
        for i, req in enumerate(batch):
            try:
                tok = tokens[i]
                if req.grammar is not None or req.logits is not None:
                    self._append_token(req, rows[i], tok, logprobs[i], now)
                    continue
                out = req.output_ids
                out.append(tok)
                if req.logprobs is not None:
                    lp = logprobs[i]
                    assert lp is not None  # both there when params.logprobs is set
                    req.logprobs.append(lp)
                if req.first_token_time is None:
                    req.first_token_time = now
                p = req.params
                if tok in eos and not p.ignore_eos:
                    self._end(req, "stop")
                elif len(out) >= p.max_tokens:
                    self._end(req, "length")
                else:
                    self._emit(req)
            except Exception:  # noqa: BLE001 - its bookkeeping failed for this one
                self._fail([req], "while sampling its next token")

    def _end(self, req: Request, reason: str) -> None:
        """``req`` ends with ``reason`` after its newest token: pages to the tree, the
        last delta out."""
        self.scheduler.finish(req)
        self._finish(req, reason)

    @staticmethod
    def _sample_row(req: Request, row: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """``req``'s token and its logprob (None unless asked) from its ``row`` alone."""
        tok = sample_token(row, req.params, req.generator)
        lp = None
        if req.params.logprobs is not None:
            lp = token_logprob(row, tok, req.params.logprobs)
        return tok, lp

    def _run_batch(self, reqs: list[Request], run) -> torch.Tensor | None:
        """``run()``'s logits, or None after failing ``reqs`` for its exception."""
        try:
            return run()
        except Exception:  # noqa: BLE001 - contained to this batch
            self._fail(reqs, "while running the batch")
            return None

    def _fail(self, reqs: list[Request], when: str) -> None:
        """End ``reqs`` with finish reason "error" for the exception being handled."""
        exc = sys.exc_info()[1]
        log.error("engine step failed for %s:\n%s", [r.rid for r in reqs], traceback.format_exc())
        self.stats.failed_steps += 1
        self.stats.consecutive_failed_steps += 1
        message = f"{type(exc).__name__} {when}"
        for req in reqs:
            if req.finished:
                continue
            # KV written by a failed step is not trusted: nothing new goes to the tree
            self.scheduler.abort(req, cache=False)
            req.error = message
            self.stats.requests_failed += 1
            self._finish(req, "error")

    def _append_token(
        self,
        req: Request,
        logits: torch.Tensor,
        tok: int,
        logprob: TokenLogprob | None,
        now: float,
        emit: bool = True,
    ) -> None:
        """Append ``req``'s sampled token ``tok`` (from ``logits``, fp32 ``[vocab]``),
        advance its grammar, end it on EOS, grammar end or ``max_tokens``, and emit the
        delta (unless not ``emit``: a later token of the same step emits). Text and stop
        strings are the front end's (:mod:`mmserve.frontend.output`).

        The engine is the only writer of ``output_ids``/``logprobs``/``logits``: a
        grammar's jump-forward comes back as an :class:`~mmserve.structured.decode.Advance`
        and is applied here."""
        p = req.params
        forced: list[int] = []
        keep, reason = True, None
        if req.grammar is not None:
            adv = self.guided.advance(req, tok, logits)
            keep, reason, forced = adv.keep, adv.reason, adv.forced
            if adv.token != tok:  # re-tokenized at a jump: its logprob from the same row
                tok = adv.token
                if logprob is not None:
                    assert p.logprobs is not None  # a logprob is there only when asked
                    logprob = token_logprob(logits, tok, p.logprobs)
        if req.first_token_time is None:
            req.first_token_time = now
        if keep:
            if req.logits is not None:
                req.logits.append(logits.detach().cpu().clone())
            if req.logprobs is not None:
                assert logprob is not None  # both there when params.logprobs is set
                req.logprobs.append(logprob)
            req.output_ids.append(tok)
            if tok in self._eos and not p.ignore_eos:
                reason = reason or "stop"
        if forced:  # not sampled: probability 1 (the grammar allowed nothing else)
            req.output_ids.extend(forced)
            if req.logprobs is not None:
                top = p.logprobs or 0
                req.logprobs.extend(TokenLogprob(t, 0.0, [(t, 0.0)] if top else []) for t in forced)
        if reason is None and len(req.output_ids) >= p.max_tokens:
            reason = "length"
        if reason is not None:
            self._end(req, reason)
            return
        if needs_extend(req):  # jumped: K/V of several new tokens
            self.scheduler.extend(req)
        if emit:  # speculation emits a step's tokens once, with the last
            self._emit(req)

    def _emit(self, req: Request) -> None:
        """Queue ``req``'s output since its last delta as a :class:`TokenDelta` (the last
        one carries the finish reason) for :meth:`flush_outputs`."""
        if req.on_update is None and self.on_outputs is None:
            return
        start = req.emitted
        req.emitted = len(req.output_ids)
        self._outbox.append((req, token_delta(req, start)))

    def flush_outputs(self) -> None:
        """Hand the deltas queued since the last flush to :attr:`on_outputs` in one call
        (one list for every request: one message per step across a thread or process),
        and each to its request's ``on_update`` when it has one (offline :meth:`track`).
        Called at the end of every :meth:`step`, :meth:`abort` and :meth:`abort_all`."""
        if not self._outbox:
            return
        out, self._outbox = self._outbox, []
        for req, delta in out:
            if req.on_update is not None:
                req.on_update(delta)
        if self.on_outputs is not None:
            self.on_outputs([d for _, d in out])

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        self.stats.count_finish(req)
        self._emit(req)

    def stop_at_next_step(self, rid: str) -> None:
        """End request ``rid`` at the next step (its text hit a stop string; KV kept)."""
        self._stop_hits.append(rid)

    def _abort_stopped(self) -> None:
        """End the requests whose tracked text hit a stop string (KV kept)."""
        while self._stop_hits:  # their deltas go with this step's
            self._abort(self._stop_hits.pop())

    def cache_stats(self) -> dict[str, float]:
        """Pool, tree and hit-rate figures for metrics and ``/v1/cache/stats``
        (:func:`~mmserve.engine.stats.cache_figures`)."""
        return cache_figures(self)

    def release_hold(self, hold: str) -> bool:
        """Unlock the prefix held under ``hold`` (:attr:`EngineRequest.hold`); False if none."""
        return self.scheduler.holds.release(hold)
