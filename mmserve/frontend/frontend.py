"""The front end's builder: one :class:`FrontEnd` for the server and the replica ingress.

:class:`FrontEnd` is what routes read (``config``, ``model``, ``processor``,
``max_context``) and what turns an engine's deltas into text
(:meth:`FrontEnd.collector`). The server builds it over its engine
(:class:`Engine`: the :class:`~mmserve.engine.engine.EngineCore` plus a front end
sharing its embedding cache, grammar cache and pool size); the replica ingress builds
it from the checkpoint's config, tokenizer and image processor only
(:func:`load_frontend_model`): the decoder and vision weights stay on the replicas, so the
ingress needs no GPU and little memory. Its requests are identical to an engine's
(``tests/test_replicas.py`` checks token ids and spans).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mmserve.config import DEFAULT_MAX_TOTAL_TOKENS, EngineConfig
from mmserve.engine.engine import EngineCore
from mmserve.frontend.output import OutputCollector
from mmserve.frontend.processor import InputProcessor
from mmserve.model import loader
from mmserve.model.llama import LlamaShape
from mmserve.model.loader import LoadedModel, text_shape
from mmserve.structured.compile import GrammarCache
from mmserve.types import EngineRequest, GenerateResult, TokenDelta
from mmserve.vision.embedding_cache import EmbeddingCache, FeatureKeys


@dataclass
class ShapeOnly:
    """Stands in for the decoder where only its shape is read (context length, vocab)."""

    shape: LlamaShape


def kv_capacity_tokens(config: EngineConfig) -> int:
    """Tokens a replica's KV pool holds with ``config`` (whole pages of ``max_total_tokens``)."""
    # a pool sized from memory (--kv-cache-memory / --mem-fraction-static) is known only
    # inside the replica; the default stands in for it here
    tokens = config.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS
    return (tokens // config.page_size) * config.page_size


def load_frontend_model(model_dir: str | Path) -> LoadedModel:
    """A :class:`LoadedModel` with config, tokenizer, processor and family but no weights.

    ``decoder`` is a :class:`ShapeOnly` and ``vision`` is None; ids (image placeholder,
    end of sequence, never sampled) are derived exactly as :func:`load_model` does.

    Raises:
        CheckpointError: as :func:`~mmserve.model.loader.load_model` does for the same
            directory (missing config, tokenizer or processor, unsupported model).
    """
    model_dir = Path(model_dir)
    config, processor, family = loader.read_front_end(model_dir)
    shape = text_shape(config)
    return loader.assemble(model_dir, config, processor, family, ShapeOnly(shape), None)  # type: ignore[arg-type]


class FrontEnd:
    """Request in, text out: the input processor and the output collectors of one model.

    Args:
        config: engine settings (limits, page size, pool size).
        model: a loaded model, or one from :func:`load_frontend_model` (no weights).
        kv_capacity: tokens the KV pool holds (None: from ``config``, as a replica's
            pool would be sized; :func:`kv_capacity_tokens`).
        embedding_cache: the engine's image-feature cache, only peeked at; or its keys
            (the engine in its own process); None: no engine to ask.
        grammars: the engine's compiled-grammar cache (None: a new one).
    """

    def __init__(
        self,
        config: EngineConfig,
        model: LoadedModel,
        kv_capacity: int | None = None,
        embedding_cache: EmbeddingCache | FeatureKeys | None = None,
        grammars: GrammarCache | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.max_context = model.decoder.shape.max_position_embeddings
        if kv_capacity is None:
            kv_capacity = kv_capacity_tokens(config)
        self.processor = InputProcessor(model, config, kv_capacity, embedding_cache, grammars)

    def collector(self, msg: EngineRequest, final_only: bool = False) -> OutputCollector:
        """A collector for ``msg``'s deltas (text, stop strings, result); ``final_only``:
        it makes only the last update (:class:`OutputCollector`)."""
        return OutputCollector(
            msg.rid,
            self.model.tokenizer,
            msg.params,
            msg.prompt_len,
            msg.arrival,
            msg.text_context,
            msg.media_tokens,
            final_only,
        )


class Engine(EngineCore):
    """The engine core with its front end: what the server and offline callers build.

    Adds to :class:`~mmserve.engine.engine.EngineCore` the :class:`FrontEnd`
    (``front``; ``processor`` is its input processor: decode, hash, template,
    tokenize, limits, run on callers' threads) and the offline API (:meth:`track`,
    :meth:`generate`).

    Arguments and errors as :class:`~mmserve.engine.engine.EngineCore` (a checkpoint path
    or a loaded model).
    """

    def __init__(self, config: EngineConfig, model: LoadedModel | None = None) -> None:
        super().__init__(config, model)
        self.front = FrontEnd(
            config, self.model, self.pool.size_tokens, self.embedding_cache, self.grammars
        )
        self.processor = self.front.processor

    def collector(self, msg: EngineRequest, final_only: bool = False) -> OutputCollector:
        """A front-end collector for ``msg``'s deltas (text, stop strings, result;
        :meth:`FrontEnd.collector`)."""
        return self.front.collector(msg, final_only)

    def track(self, msg: EngineRequest) -> OutputCollector:
        """Queue ``msg`` and collect its deltas on this thread (offline use, benchmarks):
        returns its collector; a stop string found there aborts the request at the next
        step."""
        col = self.collector(msg)

        def on_update(delta: TokenDelta) -> None:
            col.add(delta)
            if col.stop_hit:
                col.stop_hit = False
                self.stop_at_next_step(msg.rid)

        self.add_request(msg, on_update)
        return col

    def generate(self, requests: Sequence[EngineRequest]) -> list[GenerateResult]:
        """Run ``requests`` to completion together (continuous batching), collecting
        their deltas on this thread (:meth:`track`).

        Returns:
            One :class:`GenerateResult` per request, in input order.

        Raises:
            RuntimeError: if the engine runs out of work with a request unfinished
                (a scheduler bug; never a silent unfinished result).
        """
        collectors = [self.track(msg) for msg in requests]
        while not all(c.finished for c in collectors):
            if not self.has_work():
                stuck = [m.rid for m, c in zip(requests, collectors, strict=True) if not c.finished]
                raise RuntimeError(f"engine idle with unfinished requests {stuck}")
            self.step()
        self._abort_stopped()
        self.flush_outputs()  # the stopped requests' last deltas (their collectors are done)
        results: list[GenerateResult] = []
        for c in collectors:
            assert c.result is not None  # the loop above ran until every one finished
            results.append(c.result)
        return results
