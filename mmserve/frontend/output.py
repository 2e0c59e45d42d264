"""The front end's side of a request's output: token deltas in, text and results out.

One :class:`OutputCollector` per request lives wherever the deltas arrive (the event
loop of the HTTP server, a replica's ingress, or :meth:`Engine.generate` for offline
use), never on the engine thread: it owns the output ids as the client sees them,
their logprobs, the text (incremental detokenization) and stop strings. The engine
knows nothing of text; a stop string found here ends the request through an abort.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mmserve.frontend.detokenizer import TextStream
from mmserve.frontend.token_bytes import Tokenizer
from mmserve.types import GenerateResult, SamplingParams, TokenDelta, TokenLogprob


@dataclass
class StreamUpdate:
    """What one delta changed in a request's answer.

    Attributes:
        text: the answer shown so far (text that could still be the start of a stop
            string is held back until it cannot).
        delta_text: the part of ``text`` this update adds.
        delta_ids: output ids this update adds (those after a stop string excluded).
        delta_logprobs: their logprobs when asked for, else None.
        num_ids: output ids so far.
        result: set on the request's last update.
    """

    text: str
    delta_text: str = ""
    delta_ids: tuple[int, ...] = ()
    delta_logprobs: tuple[TokenLogprob, ...] | None = None
    num_ids: int = 0
    result: GenerateResult | None = None


class OutputCollector:
    """Builds one request's text and :class:`GenerateResult` from its :class:`TokenDelta`.

    The result's queue and vision tower times come from the engine's timestamps in the
    deltas, read on the clock of ``arrival`` (``time.perf_counter`` is one clock per host).

    Args:
        rid: the request id.
        tokenizer: the model's tokenizer (for incremental detokenization).
        params: the request's sampling parameters (stop strings, min_tokens, logprobs).
        prompt_tokens: prompt length in tokens.
        arrival: ``time.perf_counter()`` when the request arrived (seconds); time to
            first token and latency are measured on this side's clock when deltas arrive.
        text_context: prompt ids the text is decoded after
            (:attr:`~mmserve.types.EngineRequest.text_context`).
        media_tokens: ``(image, video)`` tokens of the prompt (reported in the result).

    Attributes:
        stop_hit: a stop string ended the answer; the engine's request should be aborted
            (its later deltas are ignored).
    """

    def __init__(
        self,
        rid: str,
        tokenizer: Tokenizer,
        params: SamplingParams,
        prompt_tokens: int,
        arrival: float,
        text_context: tuple[int, ...] = (),
        media_tokens: tuple[int, int] = (0, 0),
    ) -> None:
        self.rid = rid
        self.media_tokens = media_tokens
        self.params = params
        self.prompt_tokens = prompt_tokens
        self.arrival = arrival
        self.stream = TextStream(
            tokenizer, params.stop, getattr(params, "min_tokens", 0), text_context
        )
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.logits: list | None = [] if params.return_logits else None
        self.first_token_time: float | None = None
        self.cached_tokens = 0
        self.images_needing_vision = 0
        self.vision_tower_runs = 0
        self.admitted = 0.0  # the first admission (a retracted request is admitted again)
        self.vision_time: tuple[float, float] | None = None
        self.result: GenerateResult | None = None
        self.stop_hit = False

    @property
    def finished(self) -> bool:
        """Whether the result is known (later deltas are ignored)."""
        return self.result is not None

    def add(self, delta: TokenDelta) -> StreamUpdate | None:
        """Apply ``delta``; returns the update for the client, or None once finished.

        Output ids after the token whose text completed a stop string are dropped
        (with their logprobs), and the result says "stop", also where the stop string
        completes in the text of the last token ``max_tokens`` allowed (text held back
        until the end: the engine's "length" becomes "stop"). Text held back (a run of
        byte tokens) may show a stop string only with a later token: ids of an earlier
        update are then dropped too (the result's ids and logprobs are the ones kept).
        """
        if self.result is not None:
            return None
        self.cached_tokens = delta.cached_tokens
        self.images_needing_vision = delta.images_needing_vision
        self.vision_tower_runs = delta.vision_tower_runs
        self.admitted = self.admitted or delta.admitted
        self.vision_time = delta.vision_time
        ids = delta.token_ids
        now = time.perf_counter()  # this side's clock: a replica's deltas come from another
        if ids and self.first_token_time is None:
            self.first_token_time = now
        had = len(self.ids)
        new_text = self.stream.push(ids)
        self.ids.extend(ids)
        with_lps = False
        if self.logprobs is not None and delta.logprobs is not None:
            with_lps = True
            self.logprobs.extend(delta.logprobs[: len(ids)])
        if self.logits is not None and delta.logits is not None:
            self.logits.extend(delta.logits[: len(ids)])
        reason = delta.finish_reason
        if self.stream.stopped:
            self.stop_hit = reason is None
            reason = "stop"
        if reason is not None:
            new_text += self.stream.finish()
            if reason == "length" and self.stream.stopped:
                # the last token's text, held back until now (a run of byte tokens),
                # completed a stop string: the stop string, not the budget, ended it
                reason = "stop"
        if self.stream.stopped:  # ids up to the one whose text completed the stop string
            keep = self.stream.num_tokens
            del self.ids[keep:]
            if self.logprobs is not None:
                del self.logprobs[keep:]
            if self.logits is not None:
                del self.logits[keep:]
        if reason is not None:
            self.result = self._result(reason, delta.error, now)
        lps = tuple(self.logprobs[had:]) if with_lps and self.logprobs is not None else None
        return StreamUpdate(
            text=self.stream.text[: self.stream.sent],
            delta_text=new_text,
            delta_ids=tuple(self.ids[had:]),
            delta_logprobs=lps,
            num_ids=len(self.ids),
            result=self.result,
        )

    def fail(self, error: str) -> StreamUpdate:
        """End the request with finish reason "error" (the engine or a replica is gone)."""
        self.result = self._result("error", error, time.perf_counter())
        return StreamUpdate(
            self.stream.text[: self.stream.sent], num_ids=len(self.ids), result=self.result
        )

    def _result(self, reason: str, error: str | None, end: float) -> GenerateResult:
        first = self.first_token_time or end
        vision = self.vision_time
        return GenerateResult(
            rid=self.rid,
            text=self.stream.text,
            output_ids=list(self.ids),
            finish_reason=reason,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            image_tokens=self.media_tokens[0],
            video_tokens=self.media_tokens[1],
            completion_tokens=len(self.ids),
            images_needing_vision=self.images_needing_vision,
            vision_tower_runs=self.vision_tower_runs,
            ttft=first - self.arrival,
            latency=end - self.arrival,
            logits=self.logits,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            error=error,
            queue_time=self.admitted - self.arrival if self.admitted else None,
            vision_time=(vision[0] - self.arrival, vision[1] - self.arrival) if vision else None,
        )
