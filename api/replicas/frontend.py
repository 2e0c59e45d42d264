"""The front end without weights: what the ingress needs to turn requests into token ids.

:class:`FrontEnd` offers the part of :class:`~mmserve.engine.engine.Engine` that the
routes read (``config``, ``model``, ``processor``, ``max_context``) from the
checkpoint's config, tokenizer and image processor only: the decoder and vision
weights stay on the replicas, so the ingress needs no GPU and little memory. Its
requests are identical to an engine's (``tests/test_replicas.py`` checks token ids
and spans).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mmserve.config import DEFAULT_MAX_TOTAL_TOKENS, EngineConfig
from mmserve.engine.processor import InputProcessor
from mmserve.model import loader
from mmserve.model.llama import LlamaShape
from mmserve.model.loader import LoadedModel, text_shape


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
    """The engine's front-end surface (what routes read from ``st.engine``), without weights.

    Args:
        config: the replicas' engine settings (limits, page size, pool size).
        model: a model from :func:`load_frontend_model` (or a full one).
    """

    def __init__(self, config: EngineConfig, model: LoadedModel) -> None:
        self.config = config
        self.model = model
        self.max_context = model.decoder.shape.max_position_embeddings
        self.processor = InputProcessor(model, config, kv_capacity_tokens(config))
