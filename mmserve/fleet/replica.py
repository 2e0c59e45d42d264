"""One engine replica: a Ray Serve deployment around an :class:`~mmserve.frontend.frontend.Engine`.

A replica receives tokenized requests (:class:`~mmserve.fleet.protocol.ReplicaRequest`)
and never runs the front end. Each image arrives as its key and an ``ObjectRef`` to
its pixels, put once by the ingress: :class:`RemoteImage` fetches the pixels only
when the vision tower must run (the embedding cache missed and the prefix match did
not cover the image), and counts those fetches. Ray Serve calls
:meth:`EngineReplica.check_health` and replaces a replica whose engine has failed
``unhealthy_after_failed_steps`` steps in a row.

When a replica stops (scale-down, replacement, ``mmserve serve`` shutting down), Ray
Serve calls its ``__del__`` after draining: :meth:`EngineReplica.shutdown` aborts what
is left and closes the engine, which writes the tree's KV pages to the disk KV tier
(``--kv-disk-dir``). Every replica on a machine gets the same directory, so each finds
the pages and image features the others wrote (their disk tiers rescan it).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import ray
import torch
from ray import serve

from mmserve.config import EngineConfig
from mmserve.fleet.protocol import ControlCall, Hello, ReplicaRequest
from mmserve.frontend.async_engine import AsyncEngine
from mmserve.frontend.frontend import Engine
from mmserve.types import EngineRequest, TokenDelta
from mmserve.vision.inputs import ImageInput, ImageSpan

if TYPE_CHECKING:
    from ray import ObjectRef

    from mmserve.vision.pixels import Pixels

#: Seconds a stopping replica may spend writing its KV pages to the disk tier (on top of
#: the grace period its requests get; see ``build_application``).
FLUSH_SECONDS = 30.0


class RemoteImage(ImageInput):
    """An item whose tower input stays in Ray's object store until first read.

    Args:
        key: the item's content key.
        mode: its ``ImageInput.mode``.
        pixels: ``ObjectRef`` of its :class:`~mmserve.vision.pixels.Pixels` (preprocessed
            by the ingress).
        on_fetch: called once when the pixels are fetched.
    """

    def __init__(
        self, key: bytes, mode: str, pixels: ObjectRef[Pixels], on_fetch: Callable[[], object]
    ) -> None:
        self.key = key
        self.mode = mode
        self.image = None
        self.features = None
        self.source = None
        self._ref = pixels
        self._pixels: Pixels | None = None
        self._on_fetch = on_fetch

    @property
    def pixels(self) -> Pixels:
        """The item's ``Pixels``, fetched from the object store on first use."""
        if self._pixels is None:
            self._pixels = ray.get(self._ref)
            self._on_fetch()
        return self._pixels

    @pixels.setter
    def pixels(self, value: Pixels | None) -> None:
        # writable, as ImageInput's field is: a value set here needs no fetch
        self._pixels = value

    @property
    def pixels_ref(self) -> ObjectRef[Pixels]:
        """The ``ObjectRef`` of the pixels (what an encoder fetches instead)."""
        return self._ref

    @property
    def fetched(self) -> bool:
        """Whether the pixels have been fetched."""
        return self._pixels is not None

    def __repr__(self) -> str:
        return f"RemoteImage(key={self.key.hex()}, mode={self.mode!r}, fetched={self.fetched})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ImageInput) and (self.key, self.mode) == (other.key, other.mode)

    __hash__ = None  # type: ignore[assignment]


class EngineReplica:
    """A Ray Serve deployment class: one engine, driven by its own thread.

    Args:
        config: engine settings (``model_path`` None: the bundled tiny model, built on
            this node if missing).
        threads: torch CPU threads.
        unhealthy_after: engine steps failing in a row after which the replica reports
            itself unhealthy (Ray Serve then replaces it).
        encoders: handle of the encoder deployment (``--encoders``): features of images
            that the caches miss are asked of it before the replica's own tower runs.
    """

    def __init__(
        self,
        config: EngineConfig,
        threads: int = 1,
        unhealthy_after: int = 3,
        encoders=None,
    ) -> None:
        torch.set_num_threads(max(1, threads))
        if config.model_path is None:  # the bundled default model, as `mmserve serve` has
            from mmserve.testing import ensure_model

            config.model_path = str(ensure_model("tiny"))
        self.engine = Engine(config)
        self.encoders = None
        if encoders is not None:
            from mmserve.fleet.encoder import EncoderClient
            from mmserve.model.identity import checkpoint_identity

            # features are the vision tower's: the checkpoint and dtype, never quantized
            ident = checkpoint_identity(config.model_path, config.torch_dtype())
            self.encoders = EncoderClient(encoders, model=ident)
            self.engine.set_feature_source(self.encoders)
        self.aengine = AsyncEngine(self.engine)
        self.aengine.start()
        self.unhealthy_after = unhealthy_after
        ctx = serve.get_replica_context()
        self.uid = ctx.replica_id.unique_id
        self.pid = os.getpid()
        self.node = ray.util.get_node_ip_address()
        self.started = time.time()
        self.pixel_fetches = 0
        self.requests_received = 0

    # ---- generation ------------------------------------------------------------
    def _fetched(self) -> None:
        self.pixel_fetches += 1

    def _request(self, rr: ReplicaRequest) -> EngineRequest:
        spans = tuple(
            ImageSpan(
                s.start,
                s.length,
                RemoteImage(s.key, s.mode, s.pixels, self._fetched),
                s.modality,
            )
            for s in rr.spans
        )
        grammar = None
        if rr.params.guided is not None:  # compiled once per spec on this replica too
            grammar = self.engine.processor.grammars.compile(rr.params.guided)
        return EngineRequest(
            tuple(rr.input_ids),
            spans,
            rr.params,
            rid=rr.rid,
            grammar=grammar,
            priority=rr.priority,
            cache_salt=rr.cache_salt,
            prompt_cache_key=rr.prompt_cache_key,
            prompt_cache_retention=rr.prompt_cache_retention,
        )

    async def generate(self, rr: ReplicaRequest) -> AsyncIterator[Hello | TokenDelta]:
        """Run one request; yields :class:`Hello`, then the engine's
        :class:`~mmserve.types.TokenDelta` messages (text is the ingress's).

        Cancelling the call (the client went away, or a stop string ended the answer at
        the ingress) aborts the request in the engine.
        """
        self.requests_received += 1
        req = self._request(rr)
        yield Hello(self.uid, self.pid)
        async for delta in self.aengine.deltas(req):
            yield delta

    # ---- control -----------------------------------------------------------------
    async def control(self, call: ControlCall) -> dict:
        """Answer a :class:`ControlCall`: ``ping``, ``stats``, ``flush`` or ``health``."""
        me = {"replica": self.uid, "pid": self.pid, "node": self.node}
        if call.kind == "stats":
            return {**me, **(await self.aengine.run_on_engine(self._stats))}
        if call.kind == "flush":
            return {**me, **(await self.aengine.run_on_engine(self._flush))}
        if call.kind == "health":
            failed = self.aengine.consecutive_failures()
            return {
                **me,
                "healthy": failed < self.unhealthy_after,
                "consecutive_failed_steps": failed,
            }
        return me

    def _stats(self) -> dict:
        eng = self.engine
        stats = eng.stats_snapshot()
        stats["pixel_fetches"] = self.pixel_fetches
        stats["requests_received"] = self.requests_received
        stats["embedding_cache_entries"] = len(eng.embedding_cache)
        stats["encoder_feature_images"] = eng.remote_feature_images
        stats["encoder_fallbacks"] = self.encoders.fallbacks if self.encoders else 0
        stats["uptime_seconds"] = time.time() - self.started
        return stats

    def _flush(self) -> dict:
        try:
            return {"flushed": True, "freed_pages": self.engine.flush_cache()}
        except RuntimeError:
            return {"flushed": False, "busy": True, "freed_pages": 0}

    def check_health(self) -> None:
        """Ray Serve's health check: raises when the engine's last steps all failed."""
        fatal = self.engine.fatal_error()
        if fatal is not None:  # a tensor-parallel rank died: Ray Serve replaces the replica
            raise RuntimeError(f"engine unhealthy: {fatal}")
        failed = self.aengine.consecutive_failures()
        if failed >= self.unhealthy_after:
            raise RuntimeError(f"engine unhealthy: its last {failed} steps failed")

    def shutdown(self, timeout: float = FLUSH_SECONDS) -> int:
        """Stop the replica once: abort live requests, stop the engine thread, then close
        the engine (KV pages to the disk tier, if on, within about ``timeout`` seconds;
        tensor-parallel workers stopped). Later calls do nothing.

        Returns:
            Pages written to the disk tier (0 on later calls).
        """
        aengine = getattr(self, "aengine", None)
        if aengine is None:  # the constructor failed, or already shut down
            return 0
        del self.aengine  # a later call finds none
        aengine.call(lambda: self.engine.abort_all("abort"))
        aengine.stop()
        return self.engine.close(timeout)

    def __del__(self) -> None:
        # Ray Serve calls this when the replica stops (after draining its requests)
        self.shutdown()
