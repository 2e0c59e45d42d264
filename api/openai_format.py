"""OpenAI response shapes: completions, usage, logprobs and server-sent-event chunks."""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import AsyncIterator, Callable, Sequence
from json.encoder import encode_basestring_ascii

from api.errors import error_body
from api.structured import ToolCalling, tool_call
from api.submit import Submission
from mmserve.frontend.output import StreamUpdate
from mmserve.frontend.token_bytes import TokenBytes, token_bytes, token_string
from mmserve.types import GenerateResult, TokenLogprob

#: Logprob reported for a token the model gives no probability (OpenAI's convention).
MIN_LOGPROB = -9999.0


class TokenText:
    """Formats logprobs: each token's text and its raw bytes (:mod:`mmserve.frontend.token_bytes`).

    ``bytes`` is what the token adds to the answer's text, so the ``bytes`` of a
    choice's ``logprobs.content`` join to exactly the UTF-8 of its content (unless a
    stop string cut the text inside a token, or the answer ends inside a character):
    a byte-fallback or byte-level token holding part of a character gives its own
    bytes, never those of U+FFFD; a SentencePiece token gives its leading space except
    where decoding drops it (the answer's first word); a special token that the text
    leaves out (an end-of-sequence the model sampled, with ``ignore_eos`` or at the end)
    gives ``[]``. ``token`` is the bytes as text when they are whole UTF-8 characters,
    else OpenAI's ``"bytes:\\xe5\\x8c"`` notation; a left-out special token shows its
    own text (``"</s>"``). ``top_logprobs`` alternatives follow the same rules at their
    position.

    Args:
        tokenizer: the model's tokenizer (its byte table is built once and cached).
    """

    def __init__(self, tokenizer: object) -> None:
        self._bytes = token_bytes(tokenizer)

    def choice(self) -> ChoiceLogprobs:
        """A formatter for one choice's tokens, fed in order (possibly in pieces)."""
        return ChoiceLogprobs(self._bytes)


class ChoiceLogprobs:
    """``logprobs.content`` entries of one choice; remembers whether its text has begun
    (the first word's space may be dropped), so a stream can format it piece by piece.
    Made by :meth:`TokenText.choice`."""

    def __init__(self, table: TokenBytes) -> None:
        self._bytes = table
        self._first = True  # no text-bearing token yet

    def _entry(self, token_id: int, logprob: float) -> dict:
        raw = self._bytes.at(token_id, self._first)
        if token_id in self._bytes.skipped:
            text = self._bytes.special_text[token_id]
        else:
            text = token_string(raw)
        return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(raw)}

    def content(self, logprobs: Sequence[TokenLogprob]) -> list[dict]:
        """Entries ``{"token", "logprob", "bytes", "top_logprobs"}`` for the next tokens."""
        out = []
        for lp in logprobs:
            entry = self._entry(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [self._entry(t, v) for t, v in lp.top]
            out.append(entry)
            self._first = self._first and lp.token_id in self._bytes.skipped
        return out


def prompt_details(result: GenerateResult) -> dict:
    """``prompt_tokens_details`` (``input_tokens_details``) of one result: cached prompt
    tokens, and the prompt's image and video tokens (the rest of the prompt is text)."""
    return {
        "cached_tokens": result.cached_tokens,
        "image_tokens": result.image_tokens,
        "video_tokens": result.video_tokens,
    }


def usage(results: Sequence[GenerateResult]) -> dict:
    """OpenAI ``usage`` for the choices of one prompt.

    The prompt counts once (as in vLLM for ``n`` > 1), with the first choice's cached
    tokens; completion tokens add up over the choices. ``prompt_tokens_details`` has
    ``cached_tokens``, ``image_tokens`` and ``video_tokens`` (:func:`prompt_details`).
    """
    first = results[0]
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": prompt_details(first),
    }


def chat_completion(
    cid: str,
    created: int,
    model: str,
    results: Sequence[GenerateResult],
    tokens: TokenText | None,
    tools: ToolCalling | None = None,
) -> dict:
    """A ``chat.completion`` object; ``tokens`` set means logprobs were asked for.

    With ``tools`` (an enforced tool call) the answer is always ``tool_calls`` with
    ``content`` null: finish reason ``tool_calls`` when complete; cut short (``length``,
    or a stop string) it keeps its own finish reason and has the calls readable so far,
    each with the arguments generated so far (as OpenAI answers a cut tool call).
    """
    choices = []
    for i, r in enumerate(results):
        message: dict = {"role": "assistant", "content": r.text}
        finish = r.finish_reason
        if tools is not None:
            calls = tools.parse(r.text) if finish == "stop" else None
            if calls is not None:
                finish = "tool_calls"
            else:
                calls = [tool_call(name, args) for name, args in tools.split(r.text)]
            message = {"role": "assistant", "content": None, "tool_calls": calls}
        choices.append(
            {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": (
                    {"content": tokens.choice().content(r.logprobs or [])}
                    if tokens is not None
                    else None
                ),
            }
        )
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": usage(results),
    }


#: Characters of the ``obfuscation`` padding, and the size a padded delta is rounded up to.
_PAD_ALPHABET = string.ascii_letters + string.digits
_PAD_TO = 32


def obfuscation(delta: str) -> str:
    """Random alphanumeric padding for a streamed ``delta`` (OpenAI's ``obfuscation``
    field, ``stream_options.include_obfuscation``): 1 to 32 characters, so that the delta
    and its padding together fill a multiple of 32 characters and an event's size says
    little about its text."""
    n = _PAD_TO - len(delta) % _PAD_TO
    return "".join(secrets.choice(_PAD_ALPHABET) for _ in range(n))


class ChatChunks:
    """The server-sent events of one streamed chat completion (``chat.completion.chunk``
    objects), built update by update: :func:`chat_stream` and :func:`chat_events` send
    them.

    Each update's ``delta_text`` is sent as it is: the collector has already held back
    text that could be part of a stop string, or an incomplete character
    (:class:`~mmserve.frontend.output.StreamUpdate`), so nothing is held back here. An
    update that merges several tokens (its reader was behind) is one chunk, with every
    token's logprobs entry, in order.

    A content chunk is a template filled with the delta's JSON string (and its
    logprobs): the fields every chunk repeats are serialized once, and the bytes are
    those ``json.dumps`` of the whole object gives.

    Args:
        n: the choices.
        failure: what a choice's result means for the stream: the error to send
            (``EngineClient.failure``), or None.
        tools: an enforced tool call, streamed as ``tool_calls`` deltas (content stays
            null): each call is announced (index, id, type, name) as soon as its name is
            known (a named function's in the first chunk) and its arguments stream as they
            are generated (:meth:`~api.structured.ToolCalling.split`). The last chunk has
            finish reason ``tool_calls`` when the answer is complete; one cut short
            (``length``, a stop string) ends with its own finish reason, the arguments
            generated so far having been streamed.
        obfuscate: each chunk with new text or tool-call arguments gets an
            ``obfuscation`` field (:func:`obfuscation`).

    Attributes:
        failed: a choice ended with an engine failure; its error event was the last
            event (the caller cancels the rest and ends the stream).
    """

    def __init__(
        self,
        cid: str,
        created: int,
        model: str,
        n: int,
        tokens: TokenText | None,
        include_usage: bool,
        failure: Callable[[GenerateResult], object],
        tools: ToolCalling | None = None,
        obfuscate: bool = False,
    ) -> None:
        self.base = {"id": cid, "object": "chat.completion.chunk", "created": created}
        self.base["model"] = model
        self.include_usage = include_usage
        self.failure = failure
        self.tools = tools
        self.obfuscate = obfuscate
        self.tokens = tokens
        self.failed = False
        # a chunk's JSON is this head, its choice and the tail
        self._head = "data: " + json.dumps(self.base)[:-1] + ', "choices": ['
        self._tail = ', "usage": null' if include_usage else ""
        # a content chunk: _pre[i] + the text as a JSON string + _post (or with logprobs)
        self._pre = [f'{self._head}{{"index": {i}, "delta": {{"content": ' for i in range(n)]
        self._post = '}, "finish_reason": null, "logprobs": null}]' + self._tail + "}\n\n"
        self._post_lps = '}, "finish_reason": null, "logprobs": {"content": '
        self._end_lps = "}}]" + self._tail + "}\n\n"
        self.n = n
        self._pending: list[list[TokenLogprob]] = [[] for _ in range(n)]  # not yet sent
        self._lps_sent = [0] * n  # logprobs sent, per choice
        self._formats = [tokens.choice() for _ in range(n)] if tokens is not None else []
        self.results: list[GenerateResult | None] = [None] * n
        self._calls: list[list[str]] = [[] for _ in range(n)]  # per call: the arguments sent
        # an enforced tool call is parsed from the whole text: kept only then
        self._texts = [""] * n

    def chunk(
        self, index: int, delta: dict, finish: str | None = None, lps: list | None = None
    ) -> str:
        """One ``chat.completion.chunk`` event (any delta)."""
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        if lps is not None:
            choice["logprobs"] = {"content": lps}
        extra = self._tail
        if self.obfuscate and (delta.get("content") or delta.get("tool_calls")):
            pad = obfuscation(delta.get("content") or json.dumps(delta))
            extra += ', "obfuscation": ' + json.dumps(pad)
        return f"{self._head}{json.dumps(choice)}]{extra}}}\n\n"

    def _call_deltas(self, i: int, text: str) -> list[dict]:
        """Tool-call deltas bringing choice ``i``'s calls up to ``text``."""
        assert self.tools is not None
        calls, out = self._calls[i], []
        for k, (name, args) in enumerate(self.tools.split(text)):
            if k == len(calls):
                out.append({"index": k, **tool_call(name, args)})
                calls.append(args)
            elif len(args) > len(calls[k]):
                out.append({"index": k, "function": {"arguments": args[len(calls[k]) :]}})
                calls[k] = args
        return out

    def start(self) -> list[str]:
        """The first chunk of each choice (its role)."""
        out = []
        for i in range(self.n):
            first = {"role": "assistant", "content": None if self.tools is not None else ""}
            if self.tools is not None and (deltas := self._call_deltas(i, "")):
                first["tool_calls"] = deltas
            out.append(self.chunk(i, first))
        return out

    def add(self, i: int, upd: StreamUpdate, out: list[str]) -> None:
        """Append to ``out`` the events of choice ``i``'s update ``upd``; after a failure
        (:attr:`failed`) the error event is the last one."""
        res = upd.result
        if res is not None and (err := self.failure(res)) is not None:
            message = getattr(err, "message", str(err))
            out.append(f"data: {json.dumps(error_body(message, 'server_error'))}\n\n")
            self.failed = True
            return
        new_text = upd.delta_text
        lps = None
        if self.tokens is not None:
            pending = self._pending[i]
            pending.extend(upd.delta_logprobs or ())
            if res is not None and res.logprobs is not None:
                # a stop string shown by a later token drops ids still pending here
                pending = self._pending[i] = list(res.logprobs[self._lps_sent[i] :])
            if new_text or res is not None:
                lps = self._formats[i].content(pending)
                self._lps_sent[i] += len(pending)
                self._pending[i] = []
        finish = res.finish_reason if res is not None else None
        if self.tools is not None:
            text = self._texts[i] = self._texts[i] + new_text
            if finish == "stop" and self.tools.parse(text) is not None:
                finish = "tool_calls"
            deltas = self._call_deltas(i, text)
            if deltas or lps:
                out.append(self.chunk(i, {"tool_calls": deltas} if deltas else {}, lps=lps))
        elif not new_text and not lps:
            pass
        elif self.obfuscate:
            out.append(self.chunk(i, {"content": new_text}, lps=lps))
        elif lps is not None:
            text = _json_str(new_text)
            out.append(f"{self._pre[i]}{text}{self._post_lps}{json.dumps(lps)}{self._end_lps}")
        else:
            out.append(f"{self._pre[i]}{_json_str(new_text)}{self._post}")
        if res is not None:
            self.results[i] = res
            out.append(self.chunk(i, {}, finish))

    def end(self, complete: bool) -> list[str]:
        """The last events: the usage chunk (when asked for and every choice finished:
        ``complete``), then ``data: [DONE]``."""
        out = []
        if complete and self.include_usage and all(r is not None for r in self.results):
            results = [r for r in self.results if r is not None]
            body = {**self.base, "choices": [], "usage": usage(results)}
            out.append(f"data: {json.dumps(body)}\n\n")
        out.append("data: [DONE]\n\n")
        return out


#: A str as a JSON string, as ``json.dumps`` writes it (ASCII, escaped).
_json_str = encode_basestring_ascii


async def chat_stream(
    sub: Submission,
    cid: str,
    created: int,
    model: str,
    tokens: TokenText | None,
    include_usage: bool,
    tools: ToolCalling | None = None,
    obfuscate: bool = False,
) -> AsyncIterator[str]:
    """Server-sent events of ``chat.completion.chunk`` objects, then ``data: [DONE]``,
    one event per string (:class:`ChatChunks`; :func:`chat_events` joins what is ready).

    Args:
        sub: the running choices (each choice's updates merged while this writer is busy).
        tools: an enforced tool call (:class:`ChatChunks`).
        obfuscate: ``obfuscation`` fields (:class:`ChatChunks`).

    A choice cut short by an engine failure ends the stream with an error event
    (``sub.client.failure``). Closing the generator (the client disconnected) cancels
    ``sub``.
    """
    fmt = ChatChunks(
        cid,
        created,
        model,
        len(sub.reqs),
        tokens,
        include_usage,
        sub.client.failure,
        tools,
        obfuscate,
    )
    for event in fmt.start():
        yield event
    out: list[str] = []
    async for i, upd in sub.updates():
        fmt.add(i, upd, out)
        for event in out:
            yield event
        out.clear()
        if fmt.failed:
            sub.cancel()
            break
    for event in fmt.end(not fmt.failed):
        yield event


async def chat_events(
    sub: Submission,
    cid: str,
    created: int,
    model: str,
    tokens: TokenText | None,
    include_usage: bool,
    tools: ToolCalling | None = None,
    obfuscate: bool = False,
) -> AsyncIterator[str]:
    """The events of :func:`chat_stream`, each string everything that was ready when the
    writer woke (:meth:`~api.submit.Submission.batches`: every choice's merged update),
    so a response is written with one send per engine step at most."""
    fmt = ChatChunks(
        cid,
        created,
        model,
        len(sub.reqs),
        tokens,
        include_usage,
        sub.client.failure,
        tools,
        obfuscate,
    )
    yield "".join(fmt.start())  # at once: the client sees the answer has begun
    out: list[str] = []
    async for batch in sub.batches():
        for i, upd in batch:
            fmt.add(i, upd, out)
            if fmt.failed:
                break
        if fmt.failed:
            sub.cancel()
            break
        yield "".join(out)
        out.clear()
    yield "".join(out + fmt.end(not fmt.failed))
