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
    """What one delta (or several, :meth:`merged`) changed in a request's answer.

    An update carries only what is new: no update holds the answer's text so far (the
    final one's ``result.text`` is the whole answer). Text that could still be the start
    of a stop string, and a character not yet complete, are held back by the collector
    until they cannot be (the one hold-back; consumers send ``delta_text`` as it is).

    Attributes:
        delta_text: text this update adds to the answer.
        delta_ids: output ids this update adds (those after a stop string excluded).
        delta_logprobs: their logprobs when asked for, else None.
        num_ids: output ids so far.
        result: set on the request's last update.
    """

    delta_text: str = ""
    delta_ids: tuple[int, ...] = ()
    delta_logprobs: tuple[TokenLogprob, ...] | None = None
    num_ids: int = 0
    result: GenerateResult | None = None

    def merged(self, later: StreamUpdate) -> StreamUpdate:
        """This update followed by ``later`` (of the same request) as one update: texts,
        ids and logprobs concatenated (logprobs None only when both are), ``num_ids``
        and ``result`` from ``later``.

        A consumer slower than its request's deltas reads one merged update instead of
        a queue of them; merging is associative, and the merge of every update of a
        request equals its final-only update (:class:`OutputCollector`).
        """
        if self.delta_logprobs is None and later.delta_logprobs is None:
            lps = None
        else:
            lps = (self.delta_logprobs or ()) + (later.delta_logprobs or ())
        return StreamUpdate(
            self.delta_text + later.delta_text,
            self.delta_ids + later.delta_ids,
            lps,
            later.num_ids,
            later.result,
        )


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
        final_only: produce only the last update (non-streamed answers, ``/ask``,
            ``/qa``, batch lines): :meth:`add` returns None until the result, whose
            update carries the whole answer (text, ids, logprobs), equal to the merge of
            every update the streaming collector would have made. Without stop strings
            no text is decoded before the end (one decode of all the ids then); with stop
            strings each delta is still decoded incrementally and only its new text,
            with the few characters held back before it, is searched (the request must
            end at the token that completes a stop string).

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
        final_only: bool = False,
    ) -> None:
        self.rid = rid
        self.final_only = final_only
        self.media_tokens = media_tokens
        self.params = params
        self.prompt_tokens = prompt_tokens
        self.arrival = arrival
        self.stream = TextStream(
            tokenizer, params.stop, getattr(params, "min_tokens", 0), text_context
        )
        # final-only without stop strings: the text is decoded once, at the end
        self._decode_at_end = final_only and not self.stream.stop
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
        """Apply ``delta``; returns the update for the client, or None once finished
        (and, in final-only mode, before the last delta).

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
        stream = self.stream
        new_text = "" if self._decode_at_end else stream.push(ids)
        self.ids.extend(ids)
        with_lps = False
        if self.logprobs is not None and delta.logprobs is not None:
            with_lps = True
            self.logprobs.extend(delta.logprobs[: len(ids)])
        if self.logits is not None and delta.logits is not None:
            self.logits.extend(delta.logits[: len(ids)])
        reason = delta.finish_reason
        if stream.stopped:
            self.stop_hit = reason is None
            reason = "stop"
        if reason is None and self.final_only:
            return None
        if reason is not None:
            if self._decode_at_end:
                stream.push_whole(self.ids)
            new_text += stream.finish()
            if reason == "length" and stream.stopped:
                # the last token's text, held back until now (a run of byte tokens),
                # completed a stop string: the stop string, not the budget, ended it
                reason = "stop"
        if stream.stopped:  # ids up to the one whose text completed the stop string
            keep = stream.num_tokens
            del self.ids[keep:]
            if self.logprobs is not None:
                del self.logprobs[keep:]
            if self.logits is not None:
                del self.logits[keep:]
        if self.final_only:  # the one update: everything
            had, with_lps = 0, self.logprobs is not None
        if reason is not None:
            self.result = self._result(reason, delta.error, now)
            if self.final_only:
                new_text = self.result.text
        lps = tuple(self.logprobs[had:]) if with_lps and self.logprobs is not None else None
        return StreamUpdate(new_text, tuple(self.ids[had:]), lps, len(self.ids), self.result)

    def fail(self, error: str) -> StreamUpdate:
        """End the request with finish reason "error" (the engine or a replica is gone).

        The update adds no text or ids (in final-only mode: the whole answer so far)."""
        if self._decode_at_end and self.ids:
            self.stream.push_whole(self.ids)  # the result's text: the ids kept so far
            self._decode_at_end = False
        self.result = self._result("error", error, time.perf_counter())
        if not self.final_only:
            return StreamUpdate(num_ids=len(self.ids), result=self.result)
        lps = tuple(self.logprobs) if self.logprobs is not None else None
        return StreamUpdate(self.result.text, tuple(self.ids), lps, len(self.ids), self.result)

    def _result(self, reason: str, error: str | None, end: float) -> GenerateResult:
        first = self.first_token_time or end
        vision = self.vision_time
        return GenerateResult(
            rid=self.rid,
            text=self.stream.text,  # joined once, here
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
