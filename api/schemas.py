"""Request bodies of the OpenAI-compatible, image and video routes (extra fields are ignored)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat

from mmserve.engine.request import MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS


class ImageURL(BaseModel):
    """``image_url`` part: an uploaded image id (``img-...``) or a ``data:`` URL."""

    url: str
    detail: str | None = None


class FrameFields(BaseModel):
    """Which frames of a video: one of ``num_frames``, ``fps`` or ``timestamps``."""

    model_config = ConfigDict(extra="ignore")
    num_frames: int | None = Field(default=None, ge=1, description="frames spread uniformly")
    fps: float | None = Field(default=None, gt=0, description="frames per second of video")
    timestamps: list[float] | None = Field(default=None, description="times in seconds")


class VideoURL(FrameFields):
    """``video_url`` part: an uploaded video id (``vid-...``) or a ``data:video/...`` URL."""

    url: str


class ContentPart(FrameFields):
    """One part of a message's content: text, an image or a video (expanded into frames)."""

    type: Literal["text", "image_url", "video_url"]
    text: str | None = None
    image_url: ImageURL | str | None = None
    video_url: VideoURL | str | None = None


class ChatMessage(BaseModel):
    """A chat message; content is a string or a list of parts ("developer" acts as "system")."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with usage."""

    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema`` (OpenAI): a named JSON Schema the output must match."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, description="the schema's name")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = Field(
        default=None, description="accepted; the schema is always enforced (strict)"
    )


class ResponseFormat(BaseModel):
    """``response_format`` (OpenAI): ``text``, ``json_object`` or ``json_schema``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingFields(BaseModel):
    """Sampling fields shared by chat completions, ``/ask`` and ``/qa``.

    Structured output: at most one of ``response_format`` (``json_object`` or
    ``json_schema``), ``guided_regex``, ``guided_choice`` and ``guided_grammar``
    (vLLM's extension fields; see ``api/structured.py``).
    """

    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(default=None, description="the served model (default: it)")
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, description="vLLM extension; -1 keeps all")
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
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


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    n: int | None = Field(default=1, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None


class AskRequest(SamplingFields):
    """``POST /v1/images/{image_id}/ask`` body: several questions about one image."""

    questions: list[str] = Field(min_length=1)
    system: str | None = Field(default=None, description="an optional system message")


class VideoQARequest(SamplingFields, FrameFields):
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
    """JSON form of ``POST /v1/images``."""

    data: str = Field(description="the image file, base64-encoded")
