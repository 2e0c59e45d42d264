"""FastAPI app: image uploads and OpenAI-compatible chat completions over one engine.

``mmserve serve`` hands uvicorn the factory :func:`app_from_env` by its import
string; tests build the app around an existing :class:`~mmserve.engine.engine.Engine`
with :func:`create_app`.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from starlette.datastructures import UploadFile

from api.errors import APIError, install_error_handlers
from api.image_store import ImageStore
from api.schemas import ChatCompletionRequest, ChatMessage
from mmserve.config import EngineConfig
from mmserve.engine.async_engine import AsyncEngine
from mmserve.engine.engine import Engine, RequestError
from mmserve.engine.request import GenerateResult, ImageInput, SamplingParams
from mmserve.vision.image import ImageError, ImageLimits

IMAGE_ID = re.compile(r"^(?:mmserve://images/)?(img-[0-9a-f]{32})$")
DEFAULT_MAX_TOKENS = 256


@dataclass
class ServerSettings:
    """HTTP-level settings.

    Attributes:
        served_model_name: the name clients pass as ``model`` (default: the model dir name).
        max_stored_images: images kept by the upload store.
    """

    served_model_name: str | None = None
    max_stored_images: int = 256


def create_app(engine: Engine, settings: ServerSettings | None = None) -> FastAPI:
    """Build the FastAPI app around ``engine`` (started and stopped with the app)."""
    settings = settings or ServerSettings()
    model_name = settings.served_model_name or Path(engine.config.model_path or "mmserve").name
    aengine = AsyncEngine(engine)
    store = ImageStore(engine.prepare_image, max_images=settings.max_stored_images)
    limits: ImageLimits = engine.config.image_limits

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        yield
        aengine.stop()

    app = FastAPI(title="mmserve", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine
    app.state.async_engine = aengine
    app.state.image_store = store
    install_error_handlers(app)

    async def store_bytes(data: bytes, param: str) -> ImageInput:
        try:
            return await run_in_threadpool(store.put, data)
        except ImageError as e:
            raise APIError(400, str(e), param=param, code="invalid_image") from None

    @app.get("/health")
    async def health() -> dict:
        """Liveness: 200 while the engine thread is healthy."""
        if aengine.error is not None:
            raise APIError(500, f"engine failed: {aengine.error!r}", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        """The one served model, in the OpenAI list shape."""
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "mmserve"}],
        }

    @app.post("/v1/images")
    async def upload_image(request: Request) -> dict:
        """Upload an image: multipart field ``file``, or JSON ``{"data": "<base64>"}``.

        Identical pixels give the same id, whatever the file name or container.
        """
        ctype = request.headers.get("content-type", "")
        if ctype.startswith("multipart/form-data"):
            form = await request.form()
            file = form.get("file")
            if not isinstance(file, UploadFile):
                raise APIError(
                    400, "multipart upload needs a file field named 'file'", param="file"
                )
            data = await file.read(limits.max_bytes + 1)
            param = "file"
        elif ctype.startswith("application/json"):
            try:
                body = json.loads(await request.body())
                data = base64.b64decode(body["data"], validate=True)
            except (ValueError, KeyError, TypeError, binascii.Error):
                raise APIError(
                    400, 'JSON upload must be {"data": "<base64 image bytes>"}', param="data"
                ) from None
            param = "data"
        else:
            raise APIError(
                415, "send multipart/form-data (field 'file') or application/json ({'data': ...})"
            )
        image = await store_bytes(data, param)
        return _image_info(image, engine.model.num_image_tokens)

    @app.get("/v1/images/{image_id}")
    async def get_image(image_id: str) -> dict:
        """Metadata of an uploaded image; 404 if unknown or evicted."""
        image = store.get(image_id)
        if image is None:
            raise APIError(404, f"no image with id {image_id!r}", "not_found_error", "image_id")
        return _image_info(image, engine.model.num_image_tokens)

    async def resolve_images(messages: list[ChatMessage]) -> tuple[list[dict], list[ImageInput]]:
        out_msgs, images = [], []
        for i, m in enumerate(messages):
            if isinstance(m.content, str):
                out_msgs.append({"role": m.role, "content": m.content})
                continue
            parts = []
            for j, p in enumerate(m.content):
                param = f"messages.{i}.content.{j}"
                if p.type == "text":
                    parts.append({"type": "text", "text": p.text or ""})
                    continue
                if p.image_url is None:
                    raise APIError(400, f"{param}: image_url part without image_url", param=param)
                if m.role != "user":
                    raise APIError(400, f"{param}: images are only allowed in user messages")
                images.append(await resolve_url(p.image_url.url, param))
                parts.append({"type": "image"})
            out_msgs.append({"role": m.role, "content": parts})
        return out_msgs, images

    async def resolve_url(url: str, param: str) -> ImageInput:
        m = IMAGE_ID.match(url.strip())
        if m:
            image = store.get(m.group(1))
            if image is None:
                raise APIError(
                    400,
                    f"{param}: unknown image id {m.group(1)!r} (never uploaded or evicted); "
                    "upload it with POST /v1/images",
                    param=param,
                    code="image_not_found",
                )
            return image
        if url.startswith("data:"):
            return await store_bytes(_decode_data_url(url, param), param)
        raise APIError(
            400,
            f"{param}: only data: URLs and uploaded image ids are accepted; upload the image "
            "with POST /v1/images and pass its id (img-...) as the url",
            param=param,
            code="unsupported_image_url",
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):  # noqa: ANN202
        """OpenAI chat completion, streamed as server-sent events when ``stream`` is set."""
        if body.model != model_name:
            raise APIError(
                404,
                f"model {body.model!r} does not exist; this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )
        messages, images = await resolve_images(body.messages)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        params = SamplingParams(
            max_tokens=body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=stop,
            ignore_eos=body.ignore_eos,
        )
        try:
            req = await run_in_threadpool(
                engine.make_request, messages=messages, images=images, params=params
            )
        except RequestError as e:
            raise APIError(400, str(e), param="messages") from None
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _sse(aengine, req, cid, created, model_name, include_usage),
                media_type="text/event-stream",
            )
        result = await aengine.generate(req)
        if result.finish_reason == "abort" and aengine.error is not None:
            raise APIError(500, f"engine failed: {aengine.error!r}", "server_error")
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result.text},
                    "finish_reason": result.finish_reason,
                    "logprobs": None,
                }
            ],
            "usage": _usage(result),
        }

    @app.get("/v1/cache/stats")
    async def cache_stats() -> dict:
        """Pool, tree and hit-rate figures as JSON."""
        return await aengine.run_on_engine(engine.cache_stats)

    return app


def _image_info(image: ImageInput, num_tokens: int) -> dict:
    return {
        "id": image.id,
        "object": "image",
        "width": image.image.width,
        "height": image.image.height,
        "mode": image.image.mode,
        "num_image_tokens": num_tokens,
    }


def _decode_data_url(url: str, param: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise APIError(400, f"{param}: data URL must be data:<mime>;base64,<data>", param=param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{param}: data URL payload is not valid base64", param=param) from None


def _usage(r: GenerateResult) -> dict:
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": r.prompt_tokens + r.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
    }


async def _sse(
    aengine: AsyncEngine, req, cid: str, created: int, model: str, include_usage: bool
) -> AsyncIterator[str]:  # noqa: ANN001
    def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> str:
        body = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        if usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    sent = ""
    async for upd in aengine.stream(req):
        text = upd.text
        final = upd.result is not None
        # hold back a partial UTF-8 character until it completes
        if (
            text.startswith(sent)
            and (final or not text.endswith("\ufffd"))
            and len(text) > len(sent)
        ):
            yield chunk({"content": text[len(sent) :]})
            sent = text
        if final:
            yield chunk({}, upd.result.finish_reason)
            if include_usage:
                yield chunk({}, usage=_usage(upd.result))
    yield "data: [DONE]\n\n"


def app_from_env() -> FastAPI:
    """App factory for ``uvicorn --factory``: settings from ``MMSERVE_SERVER_CONFIG`` (JSON)."""
    raw = json.loads(os.environ.get("MMSERVE_SERVER_CONFIG", "{}"))
    limits = ImageLimits(**raw.pop("image_limits", {}))
    server = ServerSettings(**raw.pop("server", {}))
    engine = Engine(EngineConfig(**raw, image_limits=limits))
    return create_app(engine, server)


def settings_to_env(config: EngineConfig, server: ServerSettings) -> str:
    """Serialise settings for :func:`app_from_env`."""
    d = asdict(config)
    d["server"] = asdict(server)
    return json.dumps(d)
