"""The engine's boundary: what the front end hands in and what the engine hands back.

The front end (:class:`~mmserve.engine.processor.InputProcessor` on request threads,
then :class:`~mmserve.engine.output.OutputCollector` on the receiving side) turns a
client's request into a :class:`~mmserve.engine.request.Request` whose inputs
(token ids, image spans, sampling parameters) it never changes again, and reads
the engine's progress only as :class:`TokenDelta` messages. Pages, lengths, the
tree node, the grammar matcher and sampling state belong to the engine thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mmserve.engine.request import ImageSpan, SamplingParams, TokenLogprob, new_rid
from mmserve.vision.inputs import media_tokens

#: :attr:`EngineRequest.priority` of interactive traffic (the default).
INTERACTIVE = 0
#: :attr:`EngineRequest.priority` of background work (batch jobs): admitted after every
#: waiting interactive request and retracted first when decode runs out of pages.
BACKGROUND = 1


@dataclass(frozen=True)
class EngineRequest:
    """A request as the front end hands it to the engine; nothing changes it afterwards.

    Attributes:
        input_ids: prompt token ids; image (and video-frame) positions hold their
            pseudo-token ids (negative, from the content key).
        spans: the image runs of the prompt, each with its key and decoded image.
        params: sampling parameters (validated; read only from here on).
        rid: request id.
        arrival: ``time.perf_counter()`` when the request arrived (seconds).
        grammar: the compiled grammar of ``params.guided`` (compiled on the front end's
            thread, shared by every request with the same spec), else None; the engine
            makes the request's own matcher from it.
        priority: scheduling class, smaller first (:data:`INTERACTIVE` = 0,
            :data:`BACKGROUND` = 1): the scheduler admits every waiting request of a
            smaller class before any of a larger one (the cache-aware order holds inside
            each class; a request past the starvation bound goes first whatever its
            class), and retracts from the largest class first.
        text_context: the prompt's last text ids when the prompt ends inside a message
            being continued (``continue_final_message``): the output text is decoded
            after them, so it is exactly what the output adds to the prompt's text (a
            SentencePiece first token keeps its leading space); empty otherwise.
    """

    input_ids: tuple[int, ...]
    spans: tuple[ImageSpan, ...]
    params: SamplingParams
    rid: str = field(default_factory=new_rid)
    arrival: float = field(default_factory=time.perf_counter)
    grammar: Any = None
    priority: int = INTERACTIVE
    text_context: tuple[int, ...] = ()

    @property
    def prompt_len(self) -> int:
        """Prompt length in tokens."""
        return len(self.input_ids)

    @property
    def media_tokens(self) -> tuple[int, int]:
        """``(image, video)`` prompt tokens (:func:`~mmserve.vision.inputs.media_tokens`)."""
        return media_tokens(self.input_ids, self.spans)


@dataclass(frozen=True)
class TokenDelta:
    """New output of one request since its previous delta.

    Attributes:
        rid: request id.
        token_ids: ids generated since the previous delta (several after a
            structured-output jump-forward; empty on a bare finish).
        logprobs: one entry per id in ``token_ids`` when the request asked for
            logprobs, else None.
        time: ``time.perf_counter()`` when the engine produced them (seconds).
        cached_tokens: prompt tokens whose KV came from the prefix cache (set from the
            first delta on).
        images_needing_vision: images whose positions the prefix match did not cover.
        vision_tower_runs: images the vision tower encoded for this request.
        admitted: ``time.perf_counter()`` when the scheduler admitted the request (its
            queue wait ends, its prefill starts; seconds, on the clock of
            :attr:`EngineRequest.arrival`), 0.0 before.
        vision_time: ``(start, end)`` ``time.perf_counter()`` of the vision tower calls
            that encoded this request's images (first start, last end; seconds), None
            while the tower has run for none of them.
        finish_reason: on the last delta: "stop" (end of sequence or grammar end),
            "length", "abort" or "error"; None before.
        error: why the request failed (finish reason "error").
        logits: fp32 ``[vocab]`` per id when ``return_logits`` was set (tests), else None.
    """

    rid: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    time: float
    cached_tokens: int = 0
    images_needing_vision: int = 0
    vision_tower_runs: int = 0
    admitted: float = 0.0
    vision_time: tuple[float, float] | None = None
    finish_reason: str | None = None
    error: str | None = None
    logits: tuple[torch.Tensor, ...] | None = None

    @property
    def finished(self) -> bool:
        """Whether this is the request's last delta."""
        return self.finish_reason is not None
