"""The public types between the front end and the engine: parameters, messages, results.

A client's sampling parameters (:class:`SamplingParams`, checked by
:meth:`SamplingParams.validate`), the message the front end
(:mod:`mmserve.frontend`) hands the engine (:class:`EngineRequest`, frozen), the
engine's progress messages back (:class:`TokenDelta`) and what a finished request
reports (:class:`GenerateResult`, :class:`TokenLogprob`). The engine consumes these
types and never imports the front end; this module imports neither (and loads
without torch: ``torch`` and the image types are only annotations here). Pages,
lengths, the tree node, the grammar matcher and sampling state belong to the engine
thread's private :class:`~mmserve.engine.request.Request`.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mmserve.structured.spec import GuidedSpec
    from mmserve.vision.inputs import ImageSpan


@dataclass
class SamplingParams:
    """How to pick output tokens.

    Attributes:
        max_tokens: most output tokens (>= 1).
        temperature: 0 means greedy; otherwise logits are divided by it (>= 0).
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; -1 keeps all.
        seed: per-request sampling seed (None: random).
        stop: strings that end generation; the text is cut before them.
        ignore_eos: keep going after an end-of-sequence token.
        return_logits: keep each step's fp32 logits ``[vocab]`` (tests, debugging): the
            row sampled from, after the logits processors and the grammar mask, before
            temperature.
        logprobs: None (off) or how many top alternatives (0..20) to report with each
            output token's log-probability (natural log, of the unscaled distribution;
            for a constrained request, of that distribution restricted to what the
            grammar allows, see :mod:`mmserve.structured`). ``logit_bias``, the
            penalties and ``min_tokens`` are included (the distribution the token is
            drawn from, up to temperature, top-k and top-p; vLLM's default raw logprobs
            leave them out).
        guided: structured output the text must match (a JSON schema, regex, choice or
            grammar; :class:`~mmserve.structured.spec.GuidedSpec`), or None.
        logit_bias: token id -> bias in [-100, 100] added to that id's logit (OpenAI's
            ``logit_bias``); None or empty: off. Ids must be vocabulary ids (checked
            against the tokenizer by :meth:`validate` when given ``vocab_size``).
        presence_penalty: in [-2, 2]; subtracted once from the logit of every id that
            already occurs in the output (OpenAI's definition). 0: off.
        frequency_penalty: in [-2, 2]; times an id's count in the output, subtracted
            from its logit (OpenAI's definition). 0: off.
        repetition_penalty: in (0, 2]; CTRL-style (Keskar et al., arXiv 1909.05858,
            Section 4.1, as transformers and vLLM apply it) over prompt and output ids:
            a positive logit is divided by it, a negative one multiplied. 1: off.
        min_tokens: in [0, max_tokens]; until this many tokens are out, end-of-sequence
            ids cannot be sampled and stop strings are not looked for (vLLM's meaning).

    :mod:`mmserve.engine.sampling` (``LogitsProcessors``) says where and in which order
    the last five apply.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    return_logits: bool = False
    logprobs: int | None = None
    guided: GuidedSpec | None = None
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    def has_logits_processors(self) -> bool:
        """Whether logit bias, a penalty or ``min_tokens`` changes the logits at all."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Check ranges.

        Args:
            vocab_size: the tokenizer's size; when given, ``logit_bias`` ids must be
                below it.

        Raises:
            ParamError: (a ValueError) whose message starts with, and whose ``param``
                is, the parameter that is out of range.
        """
        try:
            self._validate(vocab_size)
        except ParamError:
            raise
        except ValueError as e:  # the message starts with the field's name
            raise ParamError(str(e), str(e).split(" ", 1)[0]) from None

    def _validate(self, vocab_size: int | None) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or >= 1, got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise ValueError(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0.0 < rp <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] "
                f"(1 is off), got {rp!r}"
            )
        mt = self.min_tokens
        if not _is_int(mt) or mt < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {mt!r}")
        if mt > self.max_tokens:
            raise ValueError(f"min_tokens ({mt}) must not exceed max_tokens ({self.max_tokens})")
        self._validate_logit_bias(vocab_size)

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
        for tok, value in bias.items():
            if not _is_int(tok):
                raise ValueError(f"logit_bias keys must be integer token ids, got {tok!r}")
            if tok < 0 or (vocab_size is not None and tok >= vocab_size):
                top = f"0..{vocab_size - 1}" if vocab_size is not None else "ids >= 0"
                raise ValueError(f"logit_bias has token id {tok}, outside the vocabulary ({top})")
            if not _is_number(value) or not -100.0 <= value <= 100.0:
                raise ValueError(
                    f"logit_bias values must be numbers in [-100, 100], got {value!r} "
                    f"for token id {tok}"
                )


class ParamError(ValueError):
    """A sampling parameter out of range; ``param`` names it (``logit_bias``, ...)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


#: Largest ``SamplingParams.repetition_penalty`` (vLLM's documented range is (0, 2]).
MAX_REPETITION_PENALTY = 2.0


#: Most alternatives ``SamplingParams.logprobs`` may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


@dataclass
class TokenLogprob:
    """One output token's log-probability and the most likely alternatives.

    Attributes:
        token_id: the chosen token.
        logprob: its natural-log probability under the model's (unscaled) distribution.
        top: ``(token_id, logprob)`` of the most likely tokens, best first.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class GenerateResult:
    """What a finished request reports.

    Attributes:
        rid: request id.
        text: decoded output (cut before a matched stop string).
        output_ids: generated token ids.
        finish_reason: "stop" (EOS or stop string), "length", "abort" or "error" (the
            batch that ran it failed; ``error`` says how).
        prompt_tokens: prompt length in tokens (each image counts its pseudo-tokens).
        cached_tokens: prompt tokens whose KV came from the radix cache.
        completion_tokens: ``len(output_ids)``.
        image_tokens: prompt tokens of images; video_tokens: of video frames (and each
            video's newline); the rest of ``prompt_tokens`` is text.
        images_needing_vision: images whose positions the prefix match did not cover.
        vision_tower_runs: images actually encoded by the tower (embedding-cache misses).
        ttft: seconds from arrival to the first token.
        latency: seconds from arrival to finish.
        logits: per-step fp32 logits ``[vocab]`` if ``return_logits`` was set.
        logprobs: one :class:`TokenLogprob` per output token if ``logprobs`` was set.
        error: why the request failed (finish reason "error"), else None.
        queue_time: seconds from arrival to the scheduler's first admission (the queue
            wait; prefill starts then), None if it was never admitted.
        vision_time: ``(start, end)`` seconds from arrival of the vision tower calls that
            encoded its images, None if the tower ran for none.
    """

    rid: str
    text: str
    output_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    images_needing_vision: int
    vision_tower_runs: int
    ttft: float
    latency: float
    logits: list[torch.Tensor] | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    queue_time: float | None = None
    vision_time: tuple[float, float] | None = None
    image_tokens: int = 0
    video_tokens: int = 0


_rid_counter = itertools.count()


def new_rid() -> str:
    """A process-unique request id (``req-N``)."""
    return f"req-{next(_rid_counter)}"


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
        cache_salt: the effective cache salt (:func:`mmserve.cache.salt.combine` of the
            tenant and the request's ``cache_salt``; a plain string so that it crosses a
            process boundary): requests with different salts share no cached state,
            ``""`` keys as unsalted. The front end has already re-keyed the images.
        prompt_cache_key: OpenAI's ``prompt_cache_key`` (``""``: none): under
            ``--replicas`` requests with the same key (and salt) go to the same replica.
        prompt_cache_retention: ``"24h"``: the request's cached pages are written to the
            disk KV tier when it ends (not only at eviction); ``""`` or ``"in_memory"``:
            the usual cache.
        hold: a hold id (``""``: none). A held request prefills its prompt and ends after
            its first sampled token (``max_tokens`` 1; the token is not kept); its
            prompt's full pages then stay in the radix cache, locked under this id, until
            the engine's ``release_hold(id)``. A later held request with the same id
            replaces the prefix (the new one is locked before the old one is released).
            An aborted or failed held request takes no hold. Live video streams
            (``/v1/streams``) keep their prefix so.
    """

    input_ids: tuple[int, ...]
    spans: tuple[ImageSpan, ...]
    params: SamplingParams
    rid: str = field(default_factory=new_rid)
    arrival: float = field(default_factory=time.perf_counter)
    grammar: Any = None
    priority: int = INTERACTIVE
    text_context: tuple[int, ...] = ()
    cache_salt: str = ""
    prompt_cache_key: str = ""
    prompt_cache_retention: str = ""
    hold: str = ""

    @property
    def prompt_len(self) -> int:
        """Prompt length in tokens."""
        return len(self.input_ids)

    @property
    def media_tokens(self) -> tuple[int, int]:
        """``(image, video)`` prompt tokens (:func:`~mmserve.vision.inputs.media_tokens`)."""
        from mmserve.vision.inputs import media_tokens  # torch: only when counted

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
