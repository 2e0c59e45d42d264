"""The ingress's side of the replicas: what the HTTP layer's engine client streams from.

:class:`ReplicaClient` has the one method of :class:`~mmserve.frontend.async_engine.AsyncEngine`
that submissions use, :meth:`ReplicaClient.stream`, so the single-process routes,
queue limit (503 with ``Retry-After``), metrics and disconnect handling work
unchanged: each engine request built by the front end becomes a
:class:`~mmserve.fleet.protocol.ReplicaRequest` (images as object-store references,
put once per image) sent through the Ray Serve handle, and the replica's replies
become :class:`~mmserve.frontend.async_engine.StreamUpdate` s.

When the replica dies mid-request (``RayActorError``: its process was killed, its
node lost), a request is sent once more, to another replica, unless it is a
streamed chat completion that has already sent text (then it ends with an error
event, as an engine failure does); a second failure ends it with finish reason
``error`` (HTTP 500 or an error event). Nothing waits for a dead replica: a request
that no replica starts within ``accept_seconds`` ends with an error, and a control call
for one replica fails as soon as the router stops listing it (``/health`` then counts
that replica as not healthy instead of waiting out the call's timeout).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator

import ray
from ray.exceptions import RayActorError

from mmserve.fleet.protocol import ControlCall, Hello, ReplicaRequest, SpanRef
from mmserve.fleet.registry import find_router
from mmserve.frontend.output import OutputCollector, StreamUpdate
from mmserve.frontend.token_bytes import Tokenizer
from mmserve.lru import LRU
from mmserve.types import EngineRequest, GenerateResult, TokenDelta
from mmserve.vision.inputs import ImageInput

log = logging.getLogger(__name__)

#: Set by the chat route for a streamed completion: its text reaches the client as it
#: comes, so it is not retried once any has been sent.
STREAMED: contextvars.ContextVar[bool] = contextvars.ContextVar("mmserve_streamed", default=False)


#: How often a control call for one replica checks that the replica is still running.
WATCH_SECONDS = 0.25
#: Seconds a request may wait for a replica to accept it (routing included: while no
#: replica is running, Ray Serve holds requests until a replacement joins).
ACCEPT_SECONDS = 30.0


class ReplicaGone(RuntimeError):
    """The replica a control call was for is no longer running."""


class _NotStarted(Exception):
    """No replica started a request within ``ReplicaClient.accept_seconds``."""


class ReplicaClient:
    """Sends engine requests and control calls to the replicas behind a Serve handle.

    Args:
        handle: ``DeploymentHandle`` of the replica deployment.
        app_name: the application's name (to find the router Ray Serve built here).
        tokenizer: the model's tokenizer (text is built here from token deltas).
        max_pixel_bytes: decoded pixel bytes whose object-store references are kept, so
            an image asked about again is not put again (LRU beyond it).
        accept_seconds: how long a request may wait for a replica to start it (routing
            included); beyond, it ends with an error instead of waiting on.
        model: identity of the served model
            (:func:`~mmserve.model.identity.checkpoint_identity`), sent with each request:
            the cache router keys its prefix trees on it.

    Attributes:
        retries: requests sent again after their replica died.
        replica_failures: replica deaths seen by requests.
        pixel_puts: images put into the object store.
    """

    def __init__(
        self,
        handle,
        app_name: str,
        tokenizer: Tokenizer,
        max_pixel_bytes: int = 1 << 30,
        accept_seconds: float = ACCEPT_SECONDS,
        model: bytes = b"",
    ) -> None:
        self.handle = handle
        self.model = model
        self.accept_seconds = accept_seconds
        self.tokenizer = tokenizer
        self.app_name = app_name
        self.deployment = handle.deployment_name
        self.max_pixel_bytes = max_pixel_bytes
        # key -> (object-store reference, pixel bytes); the newest stays even when alone
        # over the bound (the request being sent needs it)
        self._refs: LRU[bytes, tuple[object, int]] = LRU(
            max_bytes=max_pixel_bytes, size=lambda ref: ref[1], keep_newest=True
        )
        self.retries = 0
        self.replica_failures = 0
        self.pixel_puts = 0

    # ---- requests --------------------------------------------------------------
    def _pixels(self, image: ImageInput) -> object:
        """The object-store reference of ``image``'s tower input (``ImageInput.pixels``,
        preprocessed by the ingress's front end), put on first use (items are
        content-addressed: equal keys are equal pixels, put once).

        Raises:
            ValueError: an item without pixels for its mode (the front end always
                prepares them where no embedding cache is at hand).
        """
        hit = self._refs.get(image.key)
        if hit is not None:
            return hit[0]
        pixels = image.pixels
        if pixels is None or pixels.mode != image.mode:
            raise ValueError(f"image {image.key.hex()} has no pixels for mode {image.mode!r}")
        ref = ray.put(pixels)
        self.pixel_puts += 1
        self._refs.put(image.key, (ref, pixels.nbytes))
        return ref

    def payload(self, req: EngineRequest) -> ReplicaRequest:
        """The tokenized request a replica receives for ``req``."""
        spans = [
            SpanRef(s.start, s.length, s.image.key, s.image.mode, self._pixels(s.image), s.modality)
            for s in req.spans
        ]
        return ReplicaRequest(
            req.rid,
            list(req.input_ids),
            spans,
            req.params,
            priority=req.priority,
            model=self.model,
            cache_salt=req.cache_salt,
            prompt_cache_key=req.prompt_cache_key,
            prompt_cache_retention=req.prompt_cache_retention,
        )

    async def stream(
        self, req: EngineRequest, final_only: bool = False
    ) -> AsyncIterator[StreamUpdate]:
        """Run ``req`` on a replica; yields its updates, the last one with the result
        (``final_only``: only that one, as :meth:`AsyncEngine.stream`).

        The replica sends token deltas; text, stop strings and the result are built
        here by an :class:`OutputCollector`, as in a single-process server. A stop
        string (or the consumer stopping early) cancels the replica's call, which
        aborts the engine request.
        """
        payload = self.payload(req)
        may_retry = not STREAMED.get()
        attempt = 0
        while True:
            col = OutputCollector(
                req.rid,
                self.tokenizer,
                req.params,
                req.prompt_len,
                req.arrival,
                req.text_context,
                req.media_tokens,
                final_only,
            )
            gen = _detached(
                self.handle.options(method_name="generate", stream=True).remote, payload
            )
            replica, delivered, done, error = None, False, False, None
            replies = gen.__aiter__()
            try:
                while True:
                    try:
                        if replica is None:  # not started yet: bounded
                            msg = await self._first(replies)
                        else:
                            msg = await replies.__anext__()
                    except StopAsyncIteration:
                        break
                    if isinstance(msg, Hello):
                        replica = msg.replica
                        continue
                    assert isinstance(msg, TokenDelta)
                    upd = col.add(msg)
                    if upd is None:
                        # nothing for the client yet (final-only) or any more
                        continue
                    if upd.result is not None:
                        self._finished(req, upd.result, replica)
                        done = True
                    delivered = delivered or bool(upd.delta_text or upd.delta_ids)
                    yield upd
                    if done:
                        return
                error = f"replica {replica} ended the request without a result"
            except _NotStarted as e:
                error = str(e)
                log.warning("request %s: %s", req.rid, error)
                attempt = 1  # the replicas are gone or full: another try would wait as long
            except RayActorError as e:
                self.replica_failures += 1
                error = f"replica {replica or '(not yet known)'} died ({type(e).__name__})"
                log.warning("request %s: %s", req.rid, error)
            except Exception as e:  # any other failure ends this request only
                log.exception("request %s failed on replica %s", req.rid, replica)
                error = f"{type(e).__name__} on replica {replica}"
                attempt = 1  # not a lost replica: do not retry
            finally:
                if not done:
                    gen.cancel()
            if attempt == 0 and (may_retry or not delivered):
                attempt += 1
                self.retries += 1
                payload.avoid = replica
                continue
            yield col.fail(error)
            return

    async def _first(self, replies: AsyncIterator) -> object:
        """The first reply (the replica's :class:`Hello`), if it comes within
        ``accept_seconds``.

        Raises:
            _NotStarted: it did not.
            StopAsyncIteration: the call ended without a reply.
        """
        nxt = asyncio.ensure_future(replies.__anext__())
        try:
            done, _ = await asyncio.wait({nxt}, timeout=self.accept_seconds)
        finally:
            if not nxt.done():
                nxt.cancel()
        if not done:
            raise _NotStarted(f"no replica started the request within {self.accept_seconds} s")
        return nxt.result()

    def _finished(self, req: EngineRequest, result: GenerateResult, replica: str | None) -> None:
        """The replica's tree in the router gains the output tokens."""
        router = find_router(self.app_name, self.deployment)
        if router is not None and replica is not None and result.finish_reason != "error":
            router.record_output(
                replica, [*req.input_ids, *result.output_ids], self.model, req.cache_salt
            )

    # ---- control calls ---------------------------------------------------------
    async def call(self, kind: str, target: str | None = None, timeout: float = 10.0) -> dict:
        """One replica's answer to a control call (``target`` None: any replica).

        A call for a replica that leaves the router's set (it died) fails within
        :data:`WATCH_SECONDS` of that, without waiting out ``timeout``.

        Raises:
            TimeoutError: no answer within ``timeout`` seconds (replica gone or stuck).
            ReplicaGone: ``target`` is no longer among the running replicas.
        """
        resp = _detached(
            self.handle.options(method_name="control").remote, ControlCall(kind, target)
        )
        task = asyncio.ensure_future(_await(resp))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError(f"no answer to {kind!r} within {timeout} s")
                done, _ = await asyncio.wait({task}, timeout=min(WATCH_SECONDS, left))
                if done:
                    return task.result()
                router = find_router(self.app_name, self.deployment)
                if target is not None and router is not None:
                    if target not in router.replica_ids():
                        raise ReplicaGone(f"replica {target} is gone")
        finally:
            if not task.done():
                task.cancel()
                resp.cancel()

    async def replica_ids(self) -> list[str]:
        """Unique ids of the running replicas, as the router knows them."""
        router = find_router(self.app_name, self.deployment)
        if router is None:  # Ray Serve builds the router on the handle's first call
            try:
                await self.call("ping")
            except Exception:  # noqa: BLE001 - no replica answers: none to list
                return []
            router = find_router(self.app_name, self.deployment)
        return router.replica_ids() if router is not None else []

    async def broadcast(self, kind: str, timeout: float = 10.0) -> dict[str, dict | str]:
        """Every running replica's answer to ``kind``, or why there is none (a string)."""
        ids = await self.replica_ids()
        got = await asyncio.gather(
            *(self.call(kind, uid, timeout) for uid in ids), return_exceptions=True
        )
        out: dict[str, dict | str] = {}
        for uid, res in zip(ids, got, strict=True):
            if isinstance(res, BaseException):
                out[uid] = f"no answer ({type(res).__name__}: {res})".strip()
            else:
                out[uid] = res
        return out

    def router_snapshot(self) -> dict | None:
        """The router's counters and trees (None before its first request)."""
        router = find_router(self.app_name, self.deployment)
        return router.snapshot() if router is not None else None

    def forget(self, uid: str) -> None:
        """Tell the router that ``uid``'s cache is empty (after a flush)."""
        router = find_router(self.app_name, self.deployment)
        if router is not None:
            router.forget(uid)


def _detached(fn, *args):
    """``fn(*args)`` outside Ray Serve's request context.

    A handle call made while handling an HTTP request inherits that request's internal
    id, and a Ray Serve router hands each routing decision to the pending request with
    the decision's id; several calls of one HTTP request (``n`` > 1, ``/ask``, stats of
    every replica) would then share an id and take each other's replicas (one never
    completing). In an empty context each call gets its own id.
    """
    return contextvars.Context().run(fn, *args)


async def _await(resp) -> dict:
    return await resp


__all__ = ["STREAMED", "ReplicaClient", "ReplicaGone"]
