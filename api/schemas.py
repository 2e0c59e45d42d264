"""Request bodies of the OpenAI-compatible, image and video routes.

Field policy (README, "HTTP API"): every model forbids unknown fields, so a field
the server does not know is a 400 naming its full path (``messages[0].content[1].
image_url.foo: unknown field ...``). OpenAI fields the server knows but does not act
on are declared here and refused by :func:`_refuse_unless_default` when set to
anything but their default, with a message saying why.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from api.cache_fields import CacheSaltField, PromptCacheFields
from mmserve.types import MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS

#: The model config of every request body: unknown fields are refused.
STRICT = ConfigDict(extra="forbid", strict=True)  # "16" is not 16, true is not 1

#: Most tools in one request (OpenAI's limit).
MAX_TOOLS = 128
#: Most ``stop`` strings in one request (OpenAI's limit).
MAX_STOP = 4
#: Longest ``stop`` string (characters). A streamed answer holds back this many
#: characters less one (a stop string may be starting) and every step looks for each
#: stop string in the text's tail, so the bound keeps both small; stop strings in
#: practice are a few characters.
MAX_STOP_CHARS = 256
#: OpenAI's function name rule (tools[].function.name, tool_choice.function.name).
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


def _refuse_unless_default(
    value: Any, info: ValidationInfo, defaults: dict[str, tuple[Any, ...]], why: str
) -> Any:
    """Pass ``value`` if it is one of ``defaults[info.field_name]``, else refuse it.

    Raises:
        PydanticCustomError: ``unsupported_field``, answered as a 400 naming the field.
    """
    if value in defaults[info.field_name]:
        return value
    allowed = " or ".join(json.dumps(d) for d in defaults[info.field_name])
    raise PydanticCustomError(
        "unsupported_field",
        "not supported by this server ({why}), so it is refused rather than ignored; "
        "remove it or set it to {allowed}",
        {"why": why, "allowed": allowed},
    )


def _refusing(table: dict[str, tuple[tuple[Any, ...], str]]) -> Any:
    """A field validator for a model's fields we do not act on: ``table`` maps each field
    to ``(defaults, why)``; a value other than its defaults is refused (see
    :func:`_refuse_unless_default`)."""

    def check(cls: type, value: Any, info: ValidationInfo) -> Any:
        defaults, why = table[info.field_name]
        return _refuse_unless_default(value, info, {info.field_name: defaults}, why)

    return field_validator(*table)(classmethod(check))


#: OpenAI's ``detail`` of an image: ``"low"`` is the family's single base view (for
#: LLaVA-NeXT and OneVision the downscaled whole image, no tiles), ``"high"`` its usual
#: processing (any-resolution tiles), ``"auto"`` (the default) is ``"high"``, ``"original"``
#: the image at its own resolution within the family's limits (the grid of tiles that
#: covers it without downscaling, capped by the model's largest grid; LLaVA-1.5: "high").
Detail = Literal["auto", "low", "high", "original"]
DETAIL_HELP = (
    'image view: "low" (one base view, fewer tokens), "high" or "auto" (tiles), '
    '"original" (tiles covering the image at its own resolution)'
)


class ImageURL(BaseModel):
    """``image_url`` part: an uploaded image id (``img-...``) or a ``data:`` URL, and the
    view to process it in (``detail``, :data:`Detail`)."""

    model_config = STRICT
    url: str
    detail: Detail | None = Field(default=None, description=DETAIL_HELP)


class FrameFields(BaseModel):
    """Which frames of a video: one of ``num_frames``, ``fps`` or ``timestamps``, and the
    caps ``max_frames`` and ``max_video_tokens`` (see
    :func:`mmserve.vision.video.sample_frame_indices` for how they combine)."""

    model_config = STRICT
    num_frames: int | None = Field(default=None, ge=1, description="frames spread uniformly")
    fps: float | None = Field(default=None, gt=0, description="frames per second of video")
    timestamps: list[float] | None = Field(default=None, description="times in seconds")
    max_frames: int | None = Field(
        default=None, ge=1, description="most frames; fps and the default are thinned to it"
    )
    max_video_tokens: int | None = Field(
        default=None, ge=1, description="most tokens the frames take; fps/default thinned to fit"
    )


class VideoURL(FrameFields):
    """``video_url`` part: an uploaded video id (``vid-...``) or a ``data:video/...`` URL."""

    url: str


class ContentPart(FrameFields):
    """One part of a message's content: text, an image or a video (expanded into frames)."""

    type: Literal["text", "image_url", "video_url"]
    text: str | None = None
    image_url: ImageURL | str | None = None
    video_url: VideoURL | str | None = None


#: OpenAI message fields the server does not act on, with their accepted values.
_MESSAGE_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "name": (None,),
    "refusal": (None,),
    "audio": (None,),
    "function_call": (None,),
    "tool_calls": (None, []),
}


class ChatMessage(BaseModel):
    """A chat message; content is a string or a list of parts ("developer" acts as "system").

    OpenAI's per-role rules (null content, ``tool_call_id``, images in user messages
    only) are checked by the chat route, which names ``messages[i].<field>``. Tool turns
    are refused: a ``tool`` message, or an assistant message with ``tool_calls``, gets a
    400 naming the field, since the chat templates this server loads have no way to
    render them (give a tool's result as text in a user message). ``name``,
    ``refusal``, ``audio`` and ``function_call`` are refused when set.
    """

    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(min_length=1)] | None = None
    name: Any = None
    refusal: Any = None
    audio: Any = None
    function_call: Any = None
    tool_calls: Any = None
    tool_call_id: str | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _role(cls, value: Any) -> Any:
        if value == "function":
            raise PydanticCustomError(
                "unsupported_field",
                "'function' messages (legacy function calling) are not supported: this "
                "server does not render tool results into the prompt; give the function's "
                "result as text in a user message",
                {},
            )
        return value

    @field_validator(*_MESSAGE_DEFAULTS)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        why = {
            "tool_calls": "earlier tool calls are not rendered into the prompt; give them "
            "as text in an assistant message",
        }.get(info.field_name, "the chat template has no place for it")
        return _refuse_unless_default(value, info, _MESSAGE_DEFAULTS, why)


class StreamOptions(BaseModel):
    """``stream_options`` (only with ``stream: true``; any other key is refused).

    Attributes:
        include_usage: chat: a last chunk with empty ``choices`` carries the usage.
            Responses: accepted for clients that send it; ``response.completed`` always
            carries the usage.
        include_obfuscation: each streamed delta (a chat chunk with text, a
            ``response.*.delta`` event) gets an ``obfuscation`` field of random
            alphanumeric padding, as OpenAI adds (off unless true here).
    """

    model_config = STRICT
    include_usage: bool = False
    include_obfuscation: bool = False


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema`` (OpenAI): a named JSON Schema the output must match."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)
    name: str = Field(min_length=1, max_length=64, description="the schema's name")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = Field(
        default=None, description="accepted; the schema is always enforced (strict)"
    )


class ResponseFormat(BaseModel):
    """``response_format`` (OpenAI): ``text``, ``json_object`` or ``json_schema``."""

    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingFields(BaseModel):
    """Sampling fields shared by chat completions, ``/ask`` and ``/qa``.

    Structured output: at most one of ``response_format`` (``json_object`` or
    ``json_schema``), ``guided_regex``, ``guided_choice`` and ``guided_grammar``
    (vLLM's extension fields; see ``api/structured.py``).
    """

    model_config = STRICT
    model: str | None = Field(default=None, description="the served model (default: it)")
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, description="vLLM extension; -1 keeps all")
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = Field(
        default=None,
        description=f"up to {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters that "
        "end the answer (cut before them)",
    )
    ignore_eos: bool = False
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    guided_regex: str | None = Field(default=None, description="vLLM extension: a regex")
    guided_choice: list[str] | None = Field(
        default=None, description="vLLM extension: the output is one of these strings"
    )
    guided_grammar: str | None = Field(
        default=None, description="vLLM extension: an EBNF grammar (root rule 'root')"
    )
    # strict: a JSON true or "1.5" is refused, never read as a number
    logit_bias: dict[str, StrictFloat] | None = Field(
        default=None,
        description="token id (a decimal string) -> bias in [-100, 100] added to its logit",
    )
    presence_penalty: float | None = Field(
        default=None,
        strict=True,
        ge=-2.0,
        le=2.0,
        description="subtracted once per id already in the output",
    )
    frequency_penalty: float | None = Field(
        default=None,
        strict=True,
        ge=-2.0,
        le=2.0,
        description="times an id's count in the output, subtracted",
    )
    repetition_penalty: float | None = Field(
        default=None,
        strict=True,
        gt=0.0,
        le=MAX_REPETITION_PENALTY,
        description="vLLM extension: divides (multiplies if negative) logits of prompt and "
        "output ids; 1 is off",
    )
    min_tokens: int | None = Field(
        default=None,
        strict=True,
        ge=0,
        description="vLLM extension: no end of sequence or stop string before this many tokens",
    )


class FunctionDefinition(BaseModel):
    """``tools[].function``: a function the model may be made to call.

    ``parameters`` is the JSON Schema of its arguments (an object; absent means no
    arguments), checked like ``response_format`` schemas (api/structured.py).
    ``description`` is accepted and not shown to the model (the chat templates served
    have no tool section); ``strict`` is accepted, the schema is always enforced.
    """

    model_config = STRICT
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _function_name(value)


class Tool(BaseModel):
    """One entry of ``tools``: only ``{"type": "function", "function": {...}}``."""

    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    """``tool_choice.function``: the name of the function to call."""

    model_config = STRICT
    name: str

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _function_name(value)


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call that function."""

    model_config = STRICT
    type: Literal["function"]
    function: FunctionName


def _function_name(value: str) -> str:
    if not re.fullmatch(FUNCTION_NAME_PATTERN, value):
        raise PydanticCustomError(
            "function_name",
            "a function name is 1 to 64 letters, digits, underscores or dashes; got {name}",
            {"name": repr(value[:80])},
        )
    return value


#: Longest ``user`` / ``safety_identifier`` (characters): they go into the log line.
MAX_USER_CHARS = 256


class ChatTemplateFields(BaseModel):
    """vLLM's chat-template fields: how the prompt ends (see
    :class:`mmserve.frontend.prompt.ChatTemplateOptions`)."""

    model_config = STRICT
    add_generation_prompt: bool = Field(
        default=True, description="vLLM extension: open a new assistant turn after the last message"
    )
    continue_final_message: bool = Field(
        default=False,
        description="vLLM extension: the final assistant message is the start of the answer "
        "(no end of turn); needs add_generation_prompt false",
    )


class EndUserFields(BaseModel):
    """OpenAI's end-user identifiers: accepted and written to the request's log line."""

    model_config = STRICT
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    safety_identifier: str | None = Field(default=None, max_length=MAX_USER_CHARS)


#: OpenAI chat fields the server does not act on, with the values accepted (their
#: defaults) and why another value is refused.
_CHAT_DEFAULTS: dict[str, tuple[tuple[Any, ...], str]] = {
    "metadata": ((None, {}), "completions are not stored"),
    "store": ((None, False), "completions are not stored"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
    "modalities": ((None, ["text"]), "the output is text only"),
    "audio": ((None,), "the output is text only"),
    "prediction": ((None,), "no predicted outputs"),
    "reasoning_effort": ((None,), "the model has no reasoning setting"),
    "verbosity": ((None,), "the model has no verbosity setting"),
    "web_search_options": ((None,), "no web search"),
    "functions": ((None,), "legacy function calling: use tools and tool_choice"),
    "function_call": ((None,), "legacy function calling: use tools and tool_choice"),
}


class ChatCompletionRequest(SamplingFields, ChatTemplateFields, EndUserFields, PromptCacheFields):
    """``POST /v1/chat/completions`` body.

    Tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``) is enforced by
    constrained decoding; see :mod:`api.structured` for the rules. The fields of
    :data:`_CHAT_DEFAULTS` are refused unless left at their defaults; ``user`` and
    ``safety_identifier`` are logged.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    n: int | None = Field(default=1, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None

    _unsupported = _refusing(_CHAT_DEFAULTS)


class NoLogprobsFields(BaseModel):
    """Refuses ``logprobs`` and ``top_logprobs`` on routes whose answers carry none
    (``/ask``, ``/qa``, a stream's ``/ask``): a field the server would not act on."""

    @field_validator("logprobs", "top_logprobs", check_fields=False)
    @classmethod
    def _refused(cls, value: Any) -> Any:
        if value not in (None, False):
            raise ValueError(
                "this route's answers carry no logprobs; ask /v1/chat/completions for them"
            )
        return value


class AskRequest(NoLogprobsFields, SamplingFields, CacheSaltField):
    """``POST /v1/images/{image_id}/ask`` body: several questions about one image."""

    questions: list[str] = Field(min_length=1)
    system: str | None = Field(default=None, description="an optional system message")
    detail: Detail | None = Field(default=None, description=DETAIL_HELP)


class VideoQARequest(NoLogprobsFields, SamplingFields, FrameFields, CacheSaltField):
    """``POST /v1/videos/{video_id}/qa`` body: questions about frames of one video."""

    questions: list[str] = Field(min_length=1)
    mode: Literal["per_frame", "clip"] = Field(
        default="per_frame",
        description="per_frame: every question about every frame; clip: about all frames",
    )
    system: str | None = Field(default=None, description="an optional system message")
    stream_format: Literal["ndjson", "sse"] | None = Field(
        default=None, description="default: sse if Accept asks for text/event-stream, else ndjson"
    )


class ImageUploadJSON(BaseModel):
    """JSON form of ``POST /v1/images`` and ``POST /v1/videos`` (no other field)."""

    model_config = STRICT

    data: str = Field(description="the image file, base64-encoded")


# ---- Responses API (POST /v1/responses) -------------------------------------------------
class InputTextPart(BaseModel):
    """``{"type": "input_text", "text": ...}`` (``output_text`` in an earlier assistant turn)."""

    model_config = STRICT
    type: Literal["input_text", "output_text"]
    text: str
    # echoed back from an earlier response's output_text; descriptive only
    annotations: list[Any] | None = Field(default=None, max_length=0)
    logprobs: list[Any] | None = None


class InputImagePart(BaseModel):
    """``{"type": "input_image", "image_url": ...}``: an uploaded image id (``img-...``),
    a data URL, or an allowed file or remote URL, as in chat completions; or
    ``file_id``: the id of an image uploaded with ``POST /v1/files`` (purpose vision,
    :mod:`api.vision_files`) or ``POST /v1/images`` (one of the two fields).

    ``detail`` picks the view as in chat (:data:`Detail`).
    """

    model_config = STRICT
    type: Literal["input_image"]
    image_url: str | None = None
    detail: Detail | None = Field(default=None, description=DETAIL_HELP)
    file_id: str | None = None


class InputMessage(BaseModel):
    """One ``input`` item: a message (``type`` ``"message"`` or absent).

    ``id`` and ``status`` are accepted (and not used) so that an earlier response's
    ``output`` items can be sent back as history.
    """

    model_config = STRICT
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[InputTextPart | InputImagePart], Field(min_length=1)]
    id: str | None = None
    status: str | None = None


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (name and schema on
    the format object itself, unlike chat's ``response_format``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    """``text``: only ``format`` (``verbosity`` is refused unless null)."""

    model_config = STRICT
    format: TextFormat | None = None
    verbosity: Any = None

    @field_validator("verbosity")
    @classmethod
    def _verbosity(cls, value: Any, info: ValidationInfo) -> Any:
        why = "the model has no verbosity setting"
        return _refuse_unless_default(value, info, {"verbosity": (None,)}, why)


#: Responses fields the server does not act on: the values accepted and why others
#: are refused.
_RESPONSES_DEFAULTS: dict[str, tuple[tuple[Any, ...], str]] = {
    "tools": ((None, []), "no tools are run by this server"),
    "max_tool_calls": ((None,), "no tools are run by this server"),
    "reasoning": ((None,), "the model has no reasoning setting"),
    "include": ((None, []), "no extra output items are produced"),
    "prompt": ((None,), "no stored prompt templates"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
    "truncation": ((None, "disabled"), "input is never truncated; a too long input is a 400"),
    "top_logprobs": ((None, 0), "logprobs are not returned by /v1/responses"),
}


class ResponsesRequest(ChatTemplateFields, EndUserFields, PromptCacheFields):
    """``POST /v1/responses`` body (text and image input, text output).

    ``add_generation_prompt`` and ``continue_final_message`` are the chat route's
    (extensions here too): an assistant ``input`` item last is continued or followed by
    a new assistant turn. ``user`` and ``safety_identifier`` are logged.

    The fields of :data:`_RESPONSES_DEFAULTS` are refused unless left at their defaults;
    ``tool_choice`` and ``parallel_tool_calls`` as in a chat completion without tools
    (:func:`api.structured.refuse_tool_fields`); any other unknown field is refused as in
    every body.
    """

    model_config = STRICT
    model: str | None = Field(default=None, description="the served model (default: it)")
    input: str | list[InputMessage] = Field(min_length=1)
    instructions: str | None = Field(default=None, description="a system message put first")
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = False
    text: TextConfig | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    max_tool_calls: Any = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=128)
    conversation: str | dict[str, str] | None = None
    store: bool | None = None
    background: bool | None = None
    reasoning: Any = None
    include: Any = None
    metadata: dict[str, str] | None = None
    prompt: Any = None
    service_tier: Any = None
    truncation: Any = None
    top_logprobs: Any = None
    stream_options: StreamOptions | None = None

    _unsupported = _refusing(_RESPONSES_DEFAULTS)
