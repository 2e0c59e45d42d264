"""What every endpoint handler shares: the three steps (check, prepare, answer), run for
an HTTP route (:meth:`Endpoint.serve`) and for a batch line (:meth:`Endpoint.run_line`).

A handler is the one place that knows its endpoint's body: the 4xx checks beyond the
schema (:meth:`Endpoint.check`, with the batch's own wording where a batch line differs
from a route), the engine requests it becomes (:meth:`Endpoint.prepare`) and the OpenAI
object, stream or usage it answers with (:meth:`Endpoint.answer`,
:meth:`Endpoint.stream`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from api.disconnect import request_token
from api.errors import APIError
from api.sse import EventStreamResponse
from api.state import ServerState
from api.submit import Submission
from mmserve.types import EngineRequest, GenerateResult


class Usage(NamedTuple):
    """Tokens of one answer, as a batch adds them up: prompt tokens (counted once for
    ``n`` choices), the prompt tokens served from the prefix cache, generated tokens."""

    input: int
    cached: int
    output: int

    @classmethod
    def of(cls, results: Sequence[GenerateResult]) -> Usage:
        """The usage of the choices of one prompt: the first choice's prompt and cached
        tokens, the completion tokens of all (what ``usage`` in the body says)."""
        first = results[0]
        return cls(
            first.prompt_tokens, first.cached_tokens, sum(r.completion_tokens for r in results)
        )


class Answer(NamedTuple):
    """A finished non-streamed answer: the response body, its id (the batch record's
    ``request_id``) and its :class:`Usage`."""

    body: dict
    request_id: str
    usage: Usage


@dataclass
class Call:
    """A prepared request: the engine requests to submit and the answer's id and
    creation time (seconds since the epoch), fixed before it runs."""

    reqs: list[EngineRequest]
    id: str
    created: float


Body = TypeVar("Body", bound=BaseModel)
C = TypeVar("C", bound=Call)
#: Submits engine requests for a batch line (background priority, waits while full).
Submit = Callable[[Sequence[EngineRequest]], Awaitable[Submission]]


class Endpoint(Generic[Body, C]):
    """One POST endpoint: check, prepare, answer; shared by its route and batch lines.

    Subclasses set :attr:`path` and :attr:`body_type` and implement :meth:`prepare`,
    :meth:`answer`, :meth:`stream` and :meth:`recorded_usage` (and extend :meth:`check`).
    """

    path: ClassVar[str]
    body_type: ClassVar[type[BaseModel]]

    def parse(self, body: Any) -> Body:
        """``body`` (decoded JSON) validated against the endpoint's schema.

        Raises:
            pydantic.ValidationError: for a body the route would answer 400.
        """
        return self.body_type.model_validate(body)  # type: ignore[return-value]

    def check(self, st: ServerState, body: Body, batch: bool = False) -> None:
        """What the route checks beyond the schema before any work: the model,
        ``stream_options`` without ``stream`` (OpenAI refuses it too), and for a batch
        line (``batch``) also ``stream`` (a batch cannot stream).

        Raises:
            APIError: 404 ``model_not_found`` for another model on a route; 400 naming
                ``stream_options``, or ``stream`` or ``model`` for a batch line.
        """
        options = getattr(body, "stream_options", None)
        if not batch:
            st.check_model(body.model)  # type: ignore[attr-defined]
            if options is not None and not body.stream:  # type: ignore[attr-defined]
                raise APIError(
                    400,
                    "stream_options: not used without stream: true (a plain response always "
                    "has usage)",
                    param="stream_options",
                )
            return
        if body.stream:  # type: ignore[attr-defined]
            raise APIError(400, "stream: not available in a batch (set it false)", param="stream")
        if options is not None:
            raise APIError(400, "stream_options: not used without stream", param="stream_options")
        model = body.model  # type: ignore[attr-defined]
        if model is not None and model != st.model_name:
            raise APIError(400, f"model: this server serves {st.model_name!r}", param="model")

    async def prepare(self, st: ServerState, body: Body) -> C:
        """The engine requests of ``body`` and what its answer needs.

        Raises:
            APIError: 400 naming the field at fault (sampling fields, media, prompt).
        """
        raise NotImplementedError

    def answer(
        self, st: ServerState, body: Body, call: C, results: Sequence[GenerateResult]
    ) -> Answer:
        """The non-streamed answer of ``call`` from its finished ``results``."""
        raise NotImplementedError

    def stream(self, st: ServerState, body: Body, call: C, sub: Submission) -> AsyncIterator[str]:
        """The server-sent events of ``call`` running as ``sub``."""
        raise NotImplementedError

    def recorded_usage(self, answer: dict) -> Usage:
        """The :class:`Usage` of a response body written earlier (a batch resumed after a
        restart counts the lines already on disk)."""
        raise NotImplementedError

    async def serve(self, st: ServerState, body: Body, http: Request) -> dict | Response:
        """The route: check, prepare, submit; stream or answer (``http``: its client
        going away stops the work wherever it is: media and prompt preparation check the
        request's :class:`~mmserve.cancel.CancelToken` between items, a submission is
        refused or aborted, a stream ends).

        Raises:
            APIError: 4xx from :meth:`check` and :meth:`prepare`; 503 when the queue is
                full; 500 ``engine_error`` for a failed engine step.
            ClientDisconnected: the client went away first (the app answers 499).
        """
        self.check(st, body)
        call = await self.prepare(st, body)
        streamed = bool(body.stream)  # type: ignore[attr-defined]
        # a plain answer needs only each request's result (no per-token text work)
        sub = st.client.submit(call.reqs, final_only=not streamed)
        if streamed:
            # the submission ends its reader when the client leaves (its token's hook)
            return EventStreamResponse(self.stream(st, body, call, sub), request_token(http))
        results = await sub.answers(http)
        return self.answer(st, body, call, results).body

    async def run_line(self, st: ServerState, body: Body, submit: Submit) -> Answer:
        """A batch line (checked with :meth:`check` ``batch=True`` when its file was
        validated): prepare, submit through ``submit``, answer.

        Raises:
            APIError: what the route would answer (400 for bad media, 500 for an engine
                failure).
        """
        call = await self.prepare(st, body)
        sub = await submit(call.reqs)
        try:
            results = await sub.answers()
        finally:
            sub.cancel()
        return self.answer(st, body, call, results)
