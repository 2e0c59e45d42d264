"""From request fields to validated engine requests (sampling params, default lengths, n)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from fastapi.concurrency import run_in_threadpool

from api.errors import APIError
from api.schemas import SamplingFields
from api.structured import guided_spec
from mmserve.engine.processor import InputProcessor, RequestError
from mmserve.engine.request import ImageInput, Request, SamplingParams

_PARAM_NAMES = ("max_tokens", "temperature", "top_p", "top_k", "stop", "top_logprobs")


def sampling_params(body: SamplingFields) -> SamplingParams:
    """Validated sampling parameters; ``max_tokens`` is 0 when the client gave none.

    Structured-output fields become ``params.guided``, checked here (unsupported
    schema keywords, bad schemas, regexes and grammars), before anything is queued.

    Raises:
        APIError: 400 naming the field at fault.
    """
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    params = SamplingParams(
        max_tokens=body.max_completion_tokens or body.max_tokens or 0,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k is None else body.top_k,
        seed=body.seed,
        stop=stop,
        ignore_eos=body.ignore_eos,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        guided=guided_spec(body),
    )
    try:
        replace(params, max_tokens=params.max_tokens or 1).validate()
    except ValueError as e:
        msg = str(e)
        param = next((p for p in _PARAM_NAMES if msg.startswith(p)), None)
        raise APIError(400, msg, param=param) from None
    return params


async def make_requests(
    processor: InputProcessor,
    messages: list[dict],
    images: Sequence[ImageInput],
    params: SamplingParams,
    n: int = 1,
    default_max_tokens: int = 256,
    videos: Sequence[Sequence[ImageInput]] = (),
) -> list[Request]:
    """``n`` engine requests for one prompt; seeds ``seed``, ``seed + 1``, ... when seeded.

    ``videos`` (each its frames) fill the video parts on a model with a video path.

    ``params.max_tokens == 0`` means "not given": up to ``default_max_tokens``, capped at
    what the context and the KV pool leave after the prompt.

    Raises:
        APIError: 400 for a prompt the engine refuses (too long, bad placeholders, ...).
    """
    if not params.max_tokens:
        # the prompt alone must leave room for one token; the error then names the prompt
        first = await _make(processor, messages, images, replace(params, max_tokens=1), videos)
        room = processor.output_room(first.prompt_len)
        params = replace(params, max_tokens=max(1, min(default_max_tokens, room)))
    reqs = []
    for i in range(n):
        p = params
        if params.seed is not None and i:
            p = replace(params, seed=(params.seed + i) % (1 << 64))
        reqs.append(await _make(processor, messages, images, p, videos))
    return reqs


async def _make(
    processor: InputProcessor,
    messages: list[dict],
    images: Sequence[ImageInput],
    params: SamplingParams,
    videos: Sequence[Sequence[ImageInput]] = (),
) -> Request:
    try:  # front-end work on a worker thread, off the event loop and the engine thread
        return await run_in_threadpool(
            processor.make_request,
            messages=messages,
            images=list(images),
            params=params,
            videos=[list(v) for v in videos],
        )
    except RequestError as e:
        raise APIError(400, str(e), param=e.param or "messages") from None
