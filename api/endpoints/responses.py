"""``POST /v1/responses``: OpenAI's Responses API for text and image input, text output;
the handler shared by the route and batch lines.

The body becomes the same engine messages as a chat completion (``instructions`` as a
system message first, ``input_text`` / ``input_image`` parts as text and image parts)
and runs through the shared input path (:func:`api.endpoints.inputs.engine_requests`:
upload ids, data URLs, allowed files and remote URLs resolve as in chat).
``text.format`` goes through the structured-output machinery. Streaming sends the
Responses event sequence (``response.created`` ... ``response.completed``), each event
with its ``sequence_number`` (``stream_options``: :func:`response_stream`). Storing,
``previous_response_id``, ``conversation`` and ``background`` are
:mod:`api.stored_responses`'s (around this handler); a batch line is never stored.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from api.cache_fields import cache_options, effective_salt, with_cache_options
from api.endpoints.base import Answer, Call, Endpoint, Usage
from api.endpoints.inputs import MediaRef, engine_requests
from api.errors import APIError, error_body
from api.generation import log_end_user, sampling_params, template_options
from api.ids import IMAGE, shown
from api.media import check_image_count
from api.openai_format import obfuscation, prompt_details
from api.schemas import ResponsesRequest, SamplingFields, TextFormat
from api.state import ServerState
from api.structured import refuse_tool_fields
from api.submit import Submission
from mmserve.structured.spec import GrammarError, GuidedSpec, check_spec
from mmserve.types import GenerateResult


@dataclass
class ResponseCall(Call):
    """A prepared response: the id of its one output message."""

    msg_id: str


class ResponsesEndpoint(Endpoint[ResponsesRequest, ResponseCall]):
    """``POST /v1/responses`` (OpenAI ``responses.create``), streamed when ``stream`` is
    set; unsupported fields get a 400 naming them."""

    path = "/v1/responses"
    body_type = ResponsesRequest

    def check(self, st: ServerState, body: ResponsesRequest, batch: bool = False) -> None:
        """As :meth:`Endpoint.check`; a batch line also may not ask for storing
        (``store: true``, ``previous_response_id``, ``conversation``, ``background``).

        Raises:
            APIError: 400 naming the field.
        """
        super().check(st, body, batch)
        if not batch:
            return
        for name in ("previous_response_id", "conversation", "background", "store"):
            if getattr(body, name) not in (None, False):
                raise APIError(
                    400,
                    f"{name}: not available in a batch (batch lines are not stored; "
                    "use POST /v1/responses)",
                    param=name,
                )

    async def prepare(self, st: ServerState, body: ResponsesRequest) -> ResponseCall:
        """The engine request of ``body`` (one) and the ids of its answer.

        Raises:
            APIError: 400 naming the field at fault (``input[i].content[j].image_url``,
                ``text.format.schema``, ``max_output_tokens``, ...).
        """
        hint = "/v1/responses runs no tools"
        refuse_tool_fields(body.tool_choice, body.parallel_tool_calls, hint)
        fields = SamplingFields(
            max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p
        )
        params = sampling_params(fields)
        spec = _text_format(body.text.format if body.text is not None else None)
        if spec is not None:
            params = replace(params, guided=spec)
        messages, urls = _messages(body, st.engine.config.max_images_per_request)
        template = template_options(body, messages)
        salt = effective_salt(body.cache_salt, st.settings.shared_cache)
        options = cache_options(body, st.engine.config.kv_disk_dir)
        reqs = await engine_requests(st, messages, urls, params, 1, template, salt)
        reqs = with_cache_options(reqs, options)
        log_end_user(body, reqs)
        rid, msg_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        return ResponseCall(reqs, rid, time.time(), msg_id)

    def answer(
        self,
        st: ServerState,
        body: ResponsesRequest,
        call: ResponseCall,
        results: Sequence[GenerateResult],
    ) -> Answer:
        """The ``response`` object of the one result."""
        out = response_object(st, body, call.id, call.msg_id, call.created, results[0])
        return Answer(out, call.id, Usage.of(results))

    def stream(
        self, st: ServerState, body: ResponsesRequest, call: ResponseCall, sub: Submission
    ) -> AsyncIterator[str]:
        """The Responses event sequence (:func:`response_stream`)."""
        return response_stream(st, sub, body, call.id, call.msg_id, call.created)

    def recorded_usage(self, answer: dict) -> Usage:
        """The usage of a ``response`` object."""
        u = answer.get("usage") or {}
        cached = (u.get("input_tokens_details") or {}).get("cached_tokens", 0)
        return Usage(u.get("input_tokens", 0), cached, u.get("output_tokens", 0))


#: The Responses handler.
RESPONSES = ResponsesEndpoint()


def _text_format(fmt: TextFormat | None) -> GuidedSpec | None:
    """The structured output ``text.format`` asks for, checked (None for free text).

    Raises:
        APIError: 400 naming ``text.format...`` for a missing or unenforceable schema.
    """
    if fmt is None or fmt.type == "text":
        return None
    try:
        if fmt.type == "json_object":
            spec = GuidedSpec("json_object", "", "text.format")
        else:
            if fmt.schema_ is None:
                raise GrammarError(
                    "text.format.schema: required for type json_schema (give the JSON "
                    "Schema the output must match)",
                    "text.format.schema",
                )
            spec = GuidedSpec.json_schema(fmt.schema_, "text.format.schema")
        check_spec(spec)
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param or "text.format") from None
    return spec


def _messages(body: ResponsesRequest, max_images: int) -> tuple[list[dict], list[MediaRef]]:
    """Engine messages and each image's :class:`~api.endpoints.inputs.MediaRef`, in order.

    Raises:
        APIError: 400 for an image part without ``image_url``, an image outside a user
            message, or more images than ``max_images`` (before any is decoded).
    """
    out: list[dict] = []
    urls: list[MediaRef] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        out.append({"role": "user", "content": body.input})
    else:
        for i, m in enumerate(body.input):
            role = "system" if m.role == "developer" else m.role
            if isinstance(m.content, str):
                out.append({"role": role, "content": m.content})
                continue
            parts = []
            for j, p in enumerate(m.content):
                param = f"input[{i}].content[{j}]"
                if p.type != "input_image":
                    parts.append({"type": "text", "text": p.text})
                    continue
                url, field = _image_source(p.image_url, p.file_id, param)
                if m.role != "user":
                    raise APIError(
                        400, f"{param}: images are only allowed in user messages", param=param
                    )
                urls.append(MediaRef(url, field, None, p.detail or "auto"))
                parts.append({"type": "image"})
            out.append({"role": role, "content": parts})
    check_image_count(len(urls), max_images, "input")
    return out, urls


def _image_source(image_url: str | None, file_id: str | None, param: str) -> tuple[str, str]:
    """The image an ``input_image`` part names and the field naming it: ``image_url`` (an
    upload id, data URL or allowed URL) or ``file_id`` (an image's id, as ``POST /v1/files``
    with purpose vision or ``POST /v1/images`` gave it).

    Raises:
        APIError: 400 naming ``image_url`` when neither is given, ``file_id`` when both
            are or when it is not an image's id (a batch file's, say).
    """
    if image_url is not None and file_id is not None:
        raise APIError(
            400, f"{param}.file_id: give image_url or file_id, not both", param=f"{param}.file_id"
        )
    if file_id is not None:
        if not IMAGE.claims(file_id):
            raise APIError(
                400,
                f"{param}.file_id: {shown(file_id)} is not an image's file id; upload the "
                "image with POST /v1/files (purpose vision) or POST /v1/images and pass its id",
                param=f"{param}.file_id",
                code="invalid_image_id",
            )
        return file_id, f"{param}.file_id"
    if not image_url:
        raise APIError(
            400,
            f"{param}.image_url: required (an uploaded image id img-..., a "
            "data:image/...;base64,... URL, or file_id)",
            param=f"{param}.image_url",
        )
    return image_url, f"{param}.image_url"


def _text_config(body: ResponsesRequest) -> dict:
    fmt = body.text.format if body.text is not None else None
    if fmt is None:
        return {"format": {"type": "text"}}
    return {"format": fmt.model_dump(by_alias=True, exclude_none=True)}


def _message_item(msg_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": msg_id,
        "status": status,
        "role": "assistant",
        "content": content if status != "in_progress" else [],
    }


def response_usage(result: GenerateResult) -> dict:
    """The Responses ``usage`` object of one result (cached, image and video input tokens
    in ``input_tokens_details``)."""
    return {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": prompt_details(result),
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def response_object(
    st: ServerState,
    body: ResponsesRequest,
    rid: str,
    msg_id: str,
    created: float,
    result: GenerateResult | None,
    status: str | None = None,
) -> dict:
    """A ``response`` object; without ``result`` it is the in-progress shell (no output).

    A result cut by ``max_output_tokens`` is ``incomplete`` with ``incomplete_details``.
    """
    incomplete = result is not None and result.finish_reason == "length"
    if status is None:
        status = "incomplete" if incomplete else "completed"
    output = []
    if result is not None:
        output = [_message_item(msg_id, result.text, status)]
    return {
        "id": rid,
        "object": "response",
        "created_at": int(created),
        "status": status,
        "background": bool(body.background),
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": st.model_name,
        "output": output,
        "parallel_tool_calls": False,
        "previous_response_id": body.previous_response_id,
        "reasoning": None,
        "service_tier": "default",
        "store": bool(body.store),
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": _text_config(body),
        "tool_choice": "none",
        "tools": [],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "usage": response_usage(result) if result is not None else None,
        "metadata": body.metadata or {},
        "conversation": {"id": body.conversation} if isinstance(body.conversation, str) else None,
    }


async def response_stream(
    st: ServerState,
    sub: Submission,
    body: ResponsesRequest,
    rid: str,
    msg_id: str,
    created: float,
) -> AsyncIterator[str]:
    """Server-sent events of one response: ``response.created``, ``response.in_progress``,
    ``response.output_item.added``, ``response.content_part.added``, then
    ``response.output_text.delta`` per new text, ``response.output_text.done``,
    ``response.content_part.done``, ``response.output_item.done`` and
    ``response.completed`` (``response.incomplete`` when cut by ``max_output_tokens``).
    An engine failure ends the stream with an ``error`` event naming the request id.
    Closing the generator (client gone) cancels ``sub``.

    ``stream_options.include_obfuscation`` adds an ``obfuscation`` field of random padding
    to each ``*.delta`` event; ``include_usage`` changes nothing (``response.completed``
    always carries the usage).
    """
    seq = 0
    obfuscate = body.stream_options is not None and body.stream_options.include_obfuscation

    def event(kind: str, **fields: object) -> str:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        if obfuscate and kind.endswith(".delta"):
            data["obfuscation"] = obfuscation(str(fields.get("delta", "")))
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    shell = response_object(st, body, rid, msg_id, created, None, "in_progress")
    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)
    yield event(
        "response.output_item.added", output_index=0, item=_message_item(msg_id, "", "in_progress")
    )
    where = {"item_id": msg_id, "output_index": 0, "content_index": 0}
    empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    yield event("response.content_part.added", **where, part=empty)
    async for _, upd in sub.updates():
        res = upd.result
        failed = st.client.failure(res) if res is not None else None
        if failed is not None:
            err = error_body(failed.message, "server_error")["error"]
            yield event("error", code="engine_error", message=err["message"], param=None)
            return
        if upd.delta_text:  # held back by the collector where it could be a stop string
            yield event("response.output_text.delta", **where, delta=upd.delta_text, logprobs=[])
        if res is None:
            continue
        final = response_object(st, body, rid, msg_id, created, res)
        item = final["output"][0]
        yield event("response.output_text.done", **where, text=res.text, logprobs=[])
        yield event("response.content_part.done", **where, part=item["content"][0])
        yield event("response.output_item.done", output_index=0, item=item)
        done = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield event(done, response=final)
