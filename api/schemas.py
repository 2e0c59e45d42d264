"""Request and response bodies of the OpenAI-compatible routes."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ImageURL(BaseModel):
    """``image_url`` part: a ``data:`` URL or an uploaded image id (``img-...``)."""

    url: str
    detail: str | None = None


class ContentPart(BaseModel):
    """One part of a message's content: text or an image."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(BaseModel):
    """A chat message; content is a string or a list of parts."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with usage."""

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions`` body (the subset mmserve honours; others ignored)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
