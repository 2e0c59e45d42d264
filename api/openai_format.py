"""OpenAI response shapes: completions, usage, logprobs and server-sent-event chunks."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from functools import lru_cache

from api.errors import error_body
from api.structured import ToolCalling, tool_call
from api.submit import Submission
from mmserve.engine.request import GenerateResult, TokenLogprob

#: Logprob reported for a token the model gives no probability (OpenAI's convention).
MIN_LOGPROB = -9999.0


class TokenText:
    """Decodes single tokens for logprobs (cached per id).

    Args:
        decode: ``tokenizer.decode`` of a list of ids.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = lru_cache(maxsize=65536)(lambda i: decode([i]))

    def entry(self, token_id: int, logprob: float) -> dict:
        """``{"token", "logprob", "bytes"}`` for one token."""
        text = self._decode(token_id)
        return {
            "token": text,
            "logprob": max(logprob, MIN_LOGPROB),
            "bytes": list(text.encode("utf-8")),
        }

    def content(self, logprobs: Sequence[TokenLogprob]) -> list[dict]:
        """The ``logprobs.content`` list of a choice."""
        return [
            {
                **self.entry(lp.token_id, lp.logprob),
                "top_logprobs": [self.entry(t, v) for t, v in lp.top],
            }
            for lp in logprobs
        ]


def usage(results: Sequence[GenerateResult]) -> dict:
    """OpenAI ``usage`` for the choices of one prompt.

    The prompt counts once (as in vLLM for ``n`` > 1), with the first choice's cached
    tokens; completion tokens add up over the choices.
    """
    first = results[0]
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
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

    With ``tools`` (an enforced tool call) a complete answer becomes ``tool_calls``
    with ``content`` null and finish reason ``tool_calls``; one cut short (``length``,
    or a stop string) keeps its text as ``content`` and its own finish reason.
    """
    choices = []
    for i, r in enumerate(results):
        message: dict = {"role": "assistant", "content": r.text}
        finish = r.finish_reason
        calls = tools.parse(r.text) if tools is not None and finish == "stop" else None
        if calls is not None:
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            finish = "tool_calls"
        choices.append(
            {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": (
                    {"content": tokens.content(r.logprobs or [])} if tokens is not None else None
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


async def chat_stream(
    sub: Submission,
    cid: str,
    created: int,
    model: str,
    tokens: TokenText | None,
    include_usage: bool,
    holdback: int,
    on_failure: Callable[[GenerateResult], str | None],
    tools: ToolCalling | None = None,
) -> AsyncIterator[str]:
    """Server-sent events of ``chat.completion.chunk`` objects, then ``data: [DONE]``.

    Args:
        sub: the running choices.
        holdback: characters kept back until more text arrives (longest stop string
            minus one), so that a stop string is never partly sent.
        on_failure: message for a result cut short by an engine failure, else None.
        tools: an enforced tool call. A named function's call is announced in the
            first chunk (``tool_calls[0]`` with id, type and name) and its arguments
            stream as they are generated; with ``"required"`` the text is held back
            and the calls come in one chunk when complete. Either way the last chunk
            has finish reason ``tool_calls``. An answer cut short (``length``, a stop
            string) ends with its own finish reason: a named function's partial
            arguments have been streamed; with ``"required"`` its text comes as
            ``content``.

    Closing the generator (the client disconnected) cancels ``sub``.
    """
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(index: int, delta: dict, finish: str | None = None, lps: list | None = None) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        if lps is not None:
            choice["logprobs"] = {"content": lps}
        body = {**base, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    named = tools is not None and tools.name is not None
    held = tools is not None and not named  # "required": text held back until complete

    def text_delta(text: str) -> dict:
        if named:
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        return {"content": text}

    n = len(sub.reqs)
    sent = [""] * n
    pending: list[list[TokenLogprob]] = [[] for _ in range(n)]  # logprobs not yet sent
    results: list[GenerateResult | None] = [None] * n
    for i in range(n):
        if named:
            call = {"index": 0, **tool_call(tools.name, "")}
            yield chunk(i, {"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            yield chunk(i, {"role": "assistant", "content": None if held else ""})
    async for i, upd in sub.updates():
        final = upd.result is not None
        if final and (msg := on_failure(upd.result)) is not None:
            yield f"data: {json.dumps(error_body(msg, 'server_error'))}\n\n"
            sub.cancel()
            break
        if held and not final:
            continue
        text = upd.text
        if not final:
            text = text[: max(len(sent[i]), len(text) - holdback)]
            while text.endswith("\ufffd"):  # an incomplete UTF-8 character
                text = text[:-1]
        new_text = text[len(sent[i]) :] if text.startswith(sent[i]) else ""
        lps = None
        if tokens is not None:
            pending[i].extend(upd.delta_logprobs or ())
            if new_text or final:
                lps = tokens.content(pending[i])
                pending[i] = []
        finish = upd.result.finish_reason if final else None
        calls = tools.parse(text) if final and tools is not None and finish == "stop" else None
        if calls is not None:
            finish = "tool_calls"
        if held and calls is not None:
            delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
            yield chunk(i, delta, lps=lps)
        elif new_text or lps:
            yield chunk(i, text_delta(new_text), lps=lps)
        sent[i] += new_text
        if final:
            results[i] = upd.result
            yield chunk(i, {}, finish)
    else:
        if include_usage and all(r is not None for r in results):
            body = {**base, "choices": [], "usage": usage(results)}
            yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"
