"""Request bodies of the OpenAI-compatible and image routes (fields beyond these are ignored)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mmserve.engine.request import MAX_TOP_LOGPROBS


class ImageURL(BaseModel):
    """``image_url`` part: an uploaded image id (``img-...``) or a ``data:`` URL."""

    url: str
    detail: str | None = None


class ContentPart(BaseModel):
    """One part of a message's content: text or an image."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | str | None = None


class ChatMessage(BaseModel):
    """A chat message; content is a string or a list of parts ("developer" acts as "system")."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with usage."""

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Sampling fields shared by chat completions and ``/ask``."""

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


class ImageUploadJSON(BaseModel):
    """JSON form of ``POST /v1/images``."""

    data: str = Field(description="the image file, base64-encoded")
