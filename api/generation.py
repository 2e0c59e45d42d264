"""From request fields to validated engine requests (sampling params, default lengths, n)."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import replace

from fastapi.concurrency import run_in_threadpool

from api.errors import APIError
from api.media import busy_error
from api.schemas import (
    MAX_STOP,
    MAX_STOP_CHARS,
    ChatTemplateFields,
    EndUserFields,
    SamplingFields,
)
from api.structured import guided_spec
from mmserve.cancel import check_cancelled
from mmserve.frontend.processor import InputProcessor, RequestError
from mmserve.frontend.prompt import NEW_TURN, ChatTemplateOptions, PromptError
from mmserve.types import EngineRequest, ParamError, SamplingParams
from mmserve.vision.budget import DecodeBusyError
from mmserve.vision.inputs import ImageInput

log = logging.getLogger(__name__)

#: A ``logit_bias`` key: a token id written in decimal, no sign but "-", no leading
#: zeros, spaces or underscores (which ``int`` would accept), so two keys never name
#: one id.
_TOKEN_ID = re.compile(r"0|-?[1-9][0-9]{0,18}")


def check_questions(
    questions: Sequence[str],
    limit: int,
    processor: InputProcessor | None = None,
    system: str | None = None,
) -> None:
    """Refuse more ``questions`` than ``limit`` (``--max-questions``) in one call, and
    (given the ``processor``) a question or ``system`` text that holds the model's
    reserved image or video placeholder (it would make a slot with no picture): routes
    that take ``questions`` name the question, not ``messages``, which they do not have.

    Raises:
        APIError: 400 naming ``questions``, ``questions[i]`` or ``system``.
    """
    if len(questions) > limit:
        raise APIError(400, f"{len(questions)} questions; the limit is {limit}", param="questions")
    if processor is None:
        return
    texts = [(f"questions[{i}]", q) for i, q in enumerate(questions)]
    for field, text in [*texts, ("system", system or "")]:
        for token in processor.prompts.placeholders:
            if token in text:
                raise APIError(
                    400,
                    f"{field}: contains the model's reserved placeholder {token!r}; the "
                    "route puts the pictures in the prompt itself: leave it out",
                    param=field,
                )


def template_options(body: ChatTemplateFields, messages: Sequence[dict]) -> ChatTemplateOptions:
    """The chat-template options of ``body`` for the engine ``messages`` (roles mapped).

    Raises:
        APIError: 400 naming ``continue_final_message`` when it is set together with
            ``add_generation_prompt`` or the last message is not an assistant message.
    """
    options = ChatTemplateOptions(body.add_generation_prompt, body.continue_final_message)
    try:
        options.check(messages)
    except PromptError as e:
        raise APIError(400, str(e), param="continue_final_message") from None
    return options


def log_end_user(body: EndUserFields, reqs: Sequence[EngineRequest]) -> None:
    """Record the client's ``user`` / ``safety_identifier`` (when given) with the engine
    request ids, one INFO line (values quoted, so a newline cannot forge a line)."""
    if body.user is None and body.safety_identifier is None:
        return
    log.info(
        "requests %s: user=%r safety_identifier=%r",
        ",".join(r.rid for r in reqs),
        body.user,
        body.safety_identifier,
    )


def sampling_params(body: SamplingFields) -> SamplingParams:
    """Validated sampling parameters; ``max_tokens`` is 0 when the client gave none.

    Structured-output fields become ``params.guided``, checked here (unsupported
    schema keywords, bad schemas, regexes and grammars), before anything is queued.

    Raises:
        APIError: 400 naming the field at fault.
    """
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    stop = _stop(body.stop)
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
        logit_bias=_logit_bias(body.logit_bias),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        min_tokens=body.min_tokens or 0,
    )
    try:  # without max_tokens, the processor picks one of at least min_tokens
        replace(params, max_tokens=params.max_tokens or max(1, params.min_tokens)).validate()
    except ParamError as e:
        raise APIError(400, str(e), param=e.param) from None
    return params


def _stop(stop: str | list[str] | None) -> list[str]:
    """``stop`` as a list, within :data:`MAX_STOP` strings of :data:`MAX_STOP_CHARS`.

    Raises:
        APIError: 400 naming ``stop`` (too many) or ``stop[i]`` (too long).
    """
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > MAX_STOP:
        raise APIError(400, f"stop: {len(strings)} strings; the limit is {MAX_STOP}", param="stop")
    for i, s in enumerate(strings):
        if len(s) > MAX_STOP_CHARS:
            where = "stop" if isinstance(stop, str) else f"stop[{i}]"
            raise APIError(
                400,
                f"{where}: {len(s)} characters; a stop string has at most {MAX_STOP_CHARS}",
                param=where,
            )
    return strings


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """``logit_bias`` with its keys as ints (the vocabulary bound is checked by the
    processor, which knows the tokenizer).

    Raises:
        APIError: 400 naming ``logit_bias`` for a key that is not a decimal token id.
    """
    if not bias:
        return None
    for key in bias:
        if not _TOKEN_ID.fullmatch(key):
            raise APIError(
                400,
                f"logit_bias keys must be token ids written as decimal integers "
                f'(like "50256"), got {key[:40]!r}',
                param="logit_bias",
            )
    return {int(k): v for k, v in bias.items()}


async def make_requests(
    processor: InputProcessor,
    messages: list[dict],
    images: Sequence[ImageInput],
    params: SamplingParams,
    n: int = 1,
    default_max_tokens: int = 256,
    videos: Sequence[Sequence[ImageInput]] = (),
    template: ChatTemplateOptions = NEW_TURN,
    details: Sequence[str] = (),
    cache_salt: str = "",
) -> list[EngineRequest]:
    """``n`` engine requests for one prompt; seeds ``seed``, ``seed + 1``, ... when seeded.

    ``cache_salt`` is the effective salt (:func:`api.cache_fields.effective_salt`).

    ``videos`` (each its frames) fill the video parts on a model with a video path;
    ``template`` says how the chat template ends the prompt.
    ``details`` is each image's ``detail`` (empty: all "auto").

    ``params.max_tokens == 0`` means "not given": the processor picks it where it
    tokenizes the prompt (:meth:`~mmserve.frontend.processor.InputProcessor.default_max_tokens`:
    up to ``default_max_tokens``, capped at what the context and the KV pool leave).

    Raises:
        APIError: 400 for a prompt the engine refuses (too long, bad placeholders, ...),
            or ``min_tokens`` beyond the room the prompt leaves.
        Cancelled: the request's client left (checked before each request is built and
            inside, :mod:`mmserve.cancel`).
    """
    reqs = []
    for i in range(n):
        p = params
        if params.seed is not None and i:
            p = replace(params, seed=(params.seed + i) % (1 << 64))
        reqs.append(
            await _make(
                processor,
                messages,
                images,
                p,
                videos,
                template,
                details,
                default_max_tokens,
                cache_salt,
            )
        )
    return reqs


async def _make(
    processor: InputProcessor,
    messages: list[dict],
    images: Sequence[ImageInput],
    params: SamplingParams,
    videos: Sequence[Sequence[ImageInput]] = (),
    template: ChatTemplateOptions = NEW_TURN,
    details: Sequence[str] = (),
    default_max_tokens: int | None = None,
    cache_salt: str = "",
) -> EngineRequest:
    check_cancelled()  # the client left: no template, no tokenizing
    try:  # front-end work on a worker thread, off the event loop and the engine thread
        return await run_in_threadpool(
            processor.make_request,
            messages=messages,
            images=list(images),
            params=params,
            videos=[list(v) for v in videos],
            template=template,
            details=list(details),
            default_max_tokens=default_max_tokens,
            cache_salt=cache_salt,
        )
    except RequestError as e:
        raise APIError(400, str(e), param=e.param or "messages") from None
    except DecodeBusyError as e:  # an image decoded again (its features were evicted)
        raise busy_error(e) from None
