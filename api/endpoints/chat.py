"""``POST /v1/chat/completions``: the handler shared by the route and batch lines.

Check: the model, ``n`` against ``--max-n``, ``stream_options`` without ``stream``.
Prepare: sampling parameters (an enforced tool call becomes a grammar), each message
against OpenAI's rules for its role and each content part against its type
(:func:`split_media`), media resolved, ``n`` engine requests; so for a batch line these
message and part errors are not found when the file is validated but become the line's
400 record when it runs. Answer: a ``chat.completion`` object or its chunk stream
(:mod:`api.openai_format`), ``tool_choice`` ``"required"`` or a named function answered
as ``tool_calls`` (:func:`api.structured.tool_calling`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel

from api.cache_fields import cache_options, effective_salt, with_cache_options
from api.endpoints.base import Answer, Call, Endpoint, Usage
from api.endpoints.inputs import MediaRef, engine_requests
from api.errors import APIError, field_path
from api.generation import log_end_user, sampling_params, template_options
from api.media import check_image_count
from api.openai_format import TokenText, chat_completion, chat_events
from api.schemas import ChatCompletionRequest, ChatMessage, ContentPart, StreamOptions
from api.state import ServerState
from api.structured import ToolCalling, tool_calling
from api.submit import Submission
from api.video_media import VideoPart, selection
from mmserve.types import GenerateResult, SamplingParams


@dataclass
class ChatCall(Call):
    """A prepared chat completion: its sampling parameters, its enforced tool call (None
    without one) and the logprob formatter (None unless ``logprobs`` was asked for)."""

    params: SamplingParams
    tools: ToolCalling | None
    tokens: TokenText | None


class ChatEndpoint(Endpoint[ChatCompletionRequest, ChatCall]):
    """``POST /v1/chat/completions`` (OpenAI shape, streaming, logprobs, ``n``)."""

    path = "/v1/chat/completions"
    body_type = ChatCompletionRequest

    def check(self, st: ServerState, body: ChatCompletionRequest, batch: bool = False) -> None:
        """The model (:meth:`Endpoint.check`), ``n`` over ``--max-n`` and
        ``stream_options`` without ``stream`` (worded for a batch line with ``batch``).

        Raises:
            APIError: 404 ``model_not_found`` (route), else 400 naming the field.
        """
        super().check(st, body, batch)
        n, limit = body.n or 1, st.settings.max_n
        if n > limit:
            msg = f"n: the limit is {limit}" if batch else f"n is {n}; the limit is {limit}"
            raise APIError(400, msg, param="n")

    async def prepare(self, st: ServerState, body: ChatCompletionRequest) -> ChatCall:
        """The ``n`` engine requests of ``body``, its sampling parameters, its enforced
        tool call and (with ``logprobs``) the token formatter, built off the event loop.

        Raises:
            APIError: 400 naming the field at fault (sampling fields, media, prompt limits).
        """
        tools = tool_calling(body)
        params = sampling_params(body)
        if tools is not None:
            params = replace(params, guided=tools.spec)
        messages, urls = split_media(body.messages, st.engine.config.max_images_per_request)
        template = template_options(body, messages)
        salt = effective_salt(body.cache_salt, st.settings.shared_cache)
        options = cache_options(body, st.engine.config.kv_disk_dir)
        reqs = await engine_requests(st, messages, urls, params, body.n or 1, template, salt)
        reqs = with_cache_options(reqs, options)
        log_end_user(body, reqs)
        tokens = None
        if params.logprobs is not None:  # the byte table is built once, off the event loop
            tokens = await run_in_threadpool(TokenText, st.engine.model.tokenizer)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        return ChatCall(reqs, cid, int(time.time()), params, tools, tokens)

    def answer(
        self,
        st: ServerState,
        body: ChatCompletionRequest,
        call: ChatCall,
        results: Sequence[GenerateResult],
    ) -> Answer:
        """The ``chat.completion`` object of ``results`` (one per choice)."""
        created = int(call.created)
        out = chat_completion(call.id, created, st.model_name, results, call.tokens, call.tools)
        return Answer(out, call.id, Usage.of(results))

    def stream(
        self, st: ServerState, body: ChatCompletionRequest, call: ChatCall, sub: Submission
    ) -> AsyncIterator[str]:
        """``chat.completion.chunk`` events (:func:`api.openai_format.chat_events`: each
        string all the events ready when the writer woke, one send); a stop string is
        never partly sent (the output collector holds it back)."""
        opts = body.stream_options or StreamOptions()
        created = int(call.created)
        return chat_events(
            sub,
            call.id,
            created,
            st.model_name,
            call.tokens,
            opts.include_usage,
            call.tools,
            opts.include_obfuscation,
        )

    def recorded_usage(self, answer: dict) -> Usage:
        """The usage of a ``chat.completion`` object."""
        u = answer.get("usage") or {}
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return Usage(u.get("prompt_tokens", 0), cached, u.get("completion_tokens", 0))


#: The chat completion handler.
CHAT = ChatEndpoint()


def split_media(messages: list[ChatMessage], max_images: int) -> tuple[list[dict], list[MediaRef]]:
    """Engine messages with image and video parts, and each one's :class:`MediaRef` in
    order.

    Raises:
        APIError: 400 for a message against OpenAI's rules for its role
            (:func:`check_message`), more images than ``max_images`` (before any is
            decoded), an image outside a user message, or an image part without a url.
    """
    out, urls = [], []
    for i, m in enumerate(messages):
        check_message(m, i)
        role = "system" if m.role == "developer" else m.role
        if m.content is None or isinstance(m.content, str):
            out.append({"role": role, "content": m.content or ""})
            continue
        parts = []
        for j, p in enumerate(m.content):
            param = field_path(["messages", i, "content", j])
            _check_part_fields(p, param)
            if p.type == "text":
                parts.append({"type": "text", "text": p.text or ""})
                continue
            src = p.image_url if p.type == "image_url" else p.video_url
            url = src if isinstance(src, str) else src.url if src is not None else ""
            if not url:
                raise APIError(400, f"{param}: {p.type} part without a url", param=param)
            if m.role != "user":
                raise APIError(
                    400, f"{param}: media are only allowed in user messages", param=param
                )
            if p.type == "video_url":  # frame fields on the video_url object or on the part
                on_url = not isinstance(src, str) and bool(_given(src, _FRAME_FIELDS))
                on_part = sorted(_given(p, _FRAME_FIELDS))
                if on_url and on_part:
                    where = f"{param}.{on_part[0]}"
                    raise APIError(
                        400,
                        f"{where}: frame fields are given on both the part and its video_url; "
                        "give them in one place",
                        param=where,
                    )
                fields, at = (src, f"{param}.video_url.") if on_url else (p, f"{param}.")
                urls.append(MediaRef(url, f"{param}.video_url", VideoPart(selection(fields), at)))
                parts.append({"type": "video"})
            else:
                # the field holding the url: image_url itself, or its "url" key
                at = f"{param}.image_url" if isinstance(src, str) else f"{param}.image_url.url"
                detail = "auto" if isinstance(src, str) else src.detail or "auto"
                urls.append(MediaRef(url, at, None, detail))
                parts.append({"type": "image"})
        out.append({"role": role, "content": parts})
    check_image_count(sum(ref.frames is None for ref in urls), max_images, "messages")
    return out, urls


def check_message(m: ChatMessage, i: int) -> None:
    """OpenAI's rules for a message of each role: content is required (a string, empty
    allowed, or parts) except in an assistant message with ``tool_calls``; a ``tool``
    message needs ``tool_call_id`` and no other role has one. A well-formed tool turn is
    then refused: the chat templates served cannot render it (the schema refuses
    ``tool_calls`` for the same reason).

    Raises:
        APIError: 400 naming ``messages[i].content``, ``messages[i].tool_call_id`` or
            ``messages[i].role``.
    """
    at = f"messages[{i}]"
    if m.role == "tool" and not m.tool_call_id:
        raise APIError(
            400,
            f"{at}.tool_call_id: required in a tool message (the id of the tool call it answers)",
            param=f"{at}.tool_call_id",
        )
    if m.role != "tool" and m.tool_call_id is not None:
        raise APIError(
            400,
            f"{at}.tool_call_id: not used in a {m.role!r} message (only a tool message has one)",
            param=f"{at}.tool_call_id",
        )
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise APIError(
            400,
            f"{at}.content: {m.role!r} messages need content (a string or a list of "
            "content parts); only an assistant message with tool_calls may have none",
            param=f"{at}.content",
        )
    if m.role == "tool":
        raise APIError(
            400,
            f"{at}.role: 'tool' messages are not supported: this server does not render "
            "tool results into the prompt; give the tool's result as text in a user message",
            param=f"{at}.role",
        )


_FRAME_FIELDS = frozenset({"num_frames", "fps", "timestamps", "max_frames", "max_video_tokens"})
#: The fields each content part type uses (besides ``type``).
_PART_FIELDS = {
    "text": frozenset({"text"}),
    "image_url": frozenset({"image_url"}),
    "video_url": frozenset({"video_url"}) | _FRAME_FIELDS,
}


def _given(part: BaseModel, names: frozenset[str]) -> set[str]:
    """The fields among ``names`` that the client set to something other than null (on
    a content part or its ``video_url``)."""
    return {f for f in part.model_fields_set & names if getattr(part, f) is not None}


def _check_part_fields(part: ContentPart, param: str) -> None:
    """Refuse a field that the part's type does not use (an ``image_url`` on a text
    part, frame fields on an image part) and a text part without text.

    Raises:
        APIError: 400 naming ``messages[i].content[j].<field>``.
    """
    every = frozenset().union(*_PART_FIELDS.values())
    stray = sorted(_given(part, every - _PART_FIELDS[part.type]))
    if stray:
        where = f"{param}.{stray[0]}"
        raise APIError(
            400,
            f"{where}: not used by a {part.type!r} part, so it is refused rather than ignored",
            param=where,
        )
    if part.type == "text" and part.text is None:
        raise APIError(400, f"{param}.text: field required in a text part", param=f"{param}.text")
