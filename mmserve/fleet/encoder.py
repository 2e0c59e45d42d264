"""The vision encoder as its own Ray Serve deployment (``--encoders N``), shared by every
engine replica: an image is encoded once for the whole deployment.

An :class:`VisionEncoder` replica loads the family's vision tower and projector only
(no decoder weights, :func:`mmserve.model.loader.load_vision`). A replica whose
embedding cache and prefix cache both miss an image sends an :class:`EncodeCall`
(the image's key, mode and the ``ObjectRef`` of its pixels, which the ingress put
once); the encoder answers a :class:`FeatureRef`: the ``ObjectRef`` of the
``[tokens, text_hidden]`` features in Ray's object store, encoded on first request
and kept under the model identity and the key (content-addressed: the same key from any
replica resolves to the same object) in a :class:`FeatureStore` bounded by
``--encoder-cache-bytes``. Each call names the model it wants
(:func:`~mmserve.model.identity.checkpoint_identity`: every byte of the checkpoint's files
and the dtype): an encoder of another checkpoint (a redeployment runs old and new side by
side) refuses it, and the replica runs its own tower. The least recently used
references are dropped beyond the store's bound, and Ray frees an object once no one
holds its reference. Concurrent calls for one key share one tower run.

With several encoders, :class:`KeyAffinityRouter` sends every key to the same encoder
(rendezvous hashing over the running encoders), so each key is encoded once; when
that encoder dies its keys move to the next one in their order (Ray Serve resends a
call that its encoder did not accept). A replica that gets no features within
:data:`ENCODE_SECONDS` (every encoder dead or stuck) runs its own tower instead:
requests never fail for want of an encoder.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from mmserve.config import EngineConfig
from mmserve.fleet import registry
from mmserve.fleet.protocol import ControlCall
from mmserve.lru import LRU

if TYPE_CHECKING:
    import torch
    from ray.serve.handle import DeploymentResponse

log = logging.getLogger(__name__)

#: Seconds a replica waits for an encoder's features before running its own tower.
ENCODE_SECONDS = 20.0


@dataclass
class EncodeCall:
    """What a replica asks an encoder for: the features of one item.

    Attributes:
        key: the item's content key.
        mode: how the family encodes it (``ImageInput.mode``).
        pixels: ``ray.ObjectRef`` of its preprocessed :class:`~mmserve.vision.pixels.Pixels`.
        model: identity of the model whose features are wanted
            (:func:`~mmserve.model.identity.checkpoint_identity` of the replica's checkpoint
            and dtype); an encoder serving another one refuses the call.
    """

    key: bytes
    mode: str
    pixels: Any
    model: bytes = b""


@dataclass
class FeatureRef:
    """An encoder's answer.

    Attributes:
        key: the item's content key.
        ref: ``ray.ObjectRef`` of its ``[tokens, text_hidden]`` features (the model's
            compute dtype, on CPU).
        nbytes: size of the features in bytes.
        encoded: whether this call ran the tower (else the store held them).
        model: identity of the model that computed them (:attr:`EncodeCall.model`).
    """

    key: bytes
    ref: Any
    nbytes: int
    encoded: bool
    model: bytes = b""


class FeatureStore:
    """Object-store references of features by model identity and key, LRU-bounded in bytes.

    Dropping a reference lets Ray free the object once no replica holds it either.

    Args:
        max_bytes: most feature bytes referenced (a single larger entry is kept until
            the next one comes, so the call that made it can still be answered).
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"encoder cache bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self._lru: LRU[tuple[bytes, bytes], FeatureRef] = LRU(
            max_bytes=max_bytes, size=lambda f: f.nbytes, keep_newest=True
        )
        self.released = 0

    def get(self, key: bytes, model: bytes = b"") -> FeatureRef | None:
        """The stored answer for ``key`` computed by ``model`` (marked recently used), or
        None: another model's features of the same image are never returned."""
        return self._lru.get((model, key))

    def put(self, feature: FeatureRef) -> None:
        """Store ``feature`` under its model and key; the least recently used ones beyond
        the bound are released."""
        self.released += len(self._lru.put((feature.model, feature.key), feature))

    @property
    def nbytes(self) -> int:
        """Feature bytes referenced."""
        return self._lru.nbytes

    def __len__(self) -> int:
        return len(self._lru)


class VisionEncoder:
    """A Ray Serve deployment class: the vision tower and projector of one model.

    Args:
        config: the replicas' engine settings (``model_path`` None: the bundled tiny
            model; ``device`` and ``dtype`` as theirs, so features equal theirs).
        threads: torch CPU threads.
        cache_bytes: bound of the :class:`FeatureStore` (``--encoder-cache-bytes``).
    """

    def __init__(self, config: EngineConfig, threads: int = 1, cache_bytes: int = 1 << 30) -> None:
        import torch

        from mmserve.model.identity import checkpoint_identity
        from mmserve.model.loader import load_vision, read_front_end

        torch.set_num_threads(max(1, threads))
        if config.model_path is None:
            from mmserve.testing import ensure_model

            config.model_path = str(ensure_model("tiny"))
        model_dir = Path(config.model_path)
        _, _, family = read_front_end(model_dir)
        self.vision = load_vision(model_dir, family, config.torch_dtype(), config.device)
        # features are the vision tower's: checkpoint and dtype (never quantized)
        self.identity = checkpoint_identity(model_dir, config.torch_dtype())
        self.store = FeatureStore(cache_bytes)
        self.uid = serve.get_replica_context().replica_id.unique_id
        self.pid = os.getpid()
        self.started = time.time()
        self.runs = 0
        self.hits = 0
        self.fetches = 0
        self.queue = 0
        self._inflight: dict[tuple[bytes, bytes], asyncio.Future] = {}
        self._tower = threading.Lock()  # one tower call at a time (its own threads)

    def _encode_now(self, call: EncodeCall) -> FeatureRef:
        import torch

        pixels = ray.get(call.pixels)
        if pixels.mode != call.mode:
            raise ValueError(
                f"image {call.key.hex()} has pixels for {pixels.mode!r}, not {call.mode!r}"
            )
        with self._tower, torch.inference_mode():
            (feats,) = self.vision.encode_pixels([pixels])
        feats = feats.detach().to("cpu").contiguous()
        self.runs += 1
        nbytes = feats.numel() * feats.element_size()
        return FeatureRef(call.key, ray.put(feats), nbytes, True, self.identity)

    async def encode(self, call: EncodeCall) -> FeatureRef:
        """The features of ``call.key``: from the store, else encoded now (once however
        many replicas ask at the same time).

        Raises:
            ValueError: pixels prepared for another mode, or a call for another model
                (``call.model`` is not this encoder's identity: during a redeployment an
                encoder of the old checkpoint must not answer the new one's replicas,
                which then run their own tower).
        """
        self.fetches += 1
        if call.model != self.identity:
            raise ValueError(
                f"this encoder serves model {self.identity.hex()}, the call is for "
                f"{call.model.hex() or 'no model'}"
            )
        slot = (call.model, call.key)
        hit = self.store.get(call.key, call.model)
        if hit is not None:
            self.hits += 1
            return FeatureRef(hit.key, hit.ref, hit.nbytes, False, hit.model)
        running = self._inflight.get(slot)
        if running is not None:
            got = await asyncio.shield(running)
            return FeatureRef(got.key, got.ref, got.nbytes, False, got.model)
        fut = asyncio.get_running_loop().create_future()
        self._inflight[slot] = fut
        self.queue += 1
        try:
            got = await asyncio.to_thread(self._encode_now, call)
            self.store.put(got)
            fut.set_result(got)
            return got
        except asyncio.CancelledError:
            fut.cancel()  # callers sharing it fail too (their replicas use their own tower)
            raise
        except Exception as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: callers sharing it get it too
            raise
        finally:
            self.queue -= 1
            del self._inflight[slot]

    async def control(self, call: ControlCall) -> dict:
        """``stats`` (or any kind): this encoder's counters."""
        return {
            "encoder": self.uid,
            "pid": self.pid,
            "runs": self.runs,
            "fetches": self.fetches,
            "hits": self.hits,
            "queue": self.queue,
            "entries": len(self.store),
            "bytes": self.store.nbytes,
            "capacity_bytes": self.store.max_bytes,
            "released": self.store.released,
            "uptime_seconds": time.time() - self.started,
        }


def _score(key: bytes, uid: str) -> bytes:
    return hashlib.blake2b(key + uid.encode(), digest_size=8).digest()


class KeyAffinityRouter(RequestRouter):
    """Ray Serve router of the encoders: rendezvous hashing of the image key.

    Each key ranks the running encoders by ``hash(key, encoder id)``; the first is
    its home, so every replica's call for one key reaches the encoder that holds its
    features, and when that encoder dies only its keys move (to their second
    choice). A control call goes to its target only (none if it is gone).
    """

    def initialize_state(self, **_: object) -> None:
        """Called by Ray Serve; makes the router findable by the ingress."""
        dep = self._deployment_id
        registry.register(dep.app_name, dep.name, self)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """One rank per encoder, the key's home first; Ray Serve backs off when none
        can take the call (it asks again at once otherwise, see the replica router)."""
        call = None
        if pending_request is not None:
            args = [*pending_request.args, *pending_request.kwargs.values()]
            call = next((a for a in args if isinstance(a, (EncodeCall, ControlCall))), None)
            pending_request.routing_context.should_backoff = True
        cands = list(candidate_replicas)
        if isinstance(call, ControlCall) and call.target is not None:
            mine = [r for r in cands if r.replica_id.unique_id == call.target]
            return [mine] if mine else []
        if isinstance(call, EncodeCall):
            cands.sort(key=lambda r: _score(call.key, r.replica_id.unique_id), reverse=True)
        return [[r] for r in cands]

    def replica_ids(self) -> list[str]:
        """Unique ids of the running encoders."""
        return sorted(r.replica_id.unique_id for r in self.curr_replicas.values())


class EncoderClient:
    """A replica's side of the encoders: :attr:`ModelRunner.feature_source`.

    Called on a feature-load worker thread (never the engine's step, never an event
    loop: :class:`~mmserve.engine.scheduler.features.FeatureLoads`), several at once:
    the request waits "loading" while other requests decode. Each item is asked of the
    encoders and its features fetched; any failure or a wait beyond ``timeout`` gives
    None for that item, so the replica runs its own tower for it.

    Args:
        handle: ``DeploymentHandle`` of the encoder deployment.
        timeout: seconds per item (:data:`ENCODE_SECONDS`).
        model: the replica's :func:`~mmserve.model.identity.checkpoint_identity` (its
            checkpoint and dtype), sent with each call: only an encoder of the same model
            answers, and a feature it answered is checked to be that model's.

    Attributes:
        fetched: items whose features came from an encoder.
        fallbacks: items an encoder did not answer in time (the replica's tower ran).
    """

    def __init__(self, handle, timeout: float = ENCODE_SECONDS, model: bytes = b"") -> None:
        self.handle = handle
        self.timeout = timeout
        self.model = model
        self.fetched = 0
        self.fallbacks = 0
        self._count = threading.Lock()  # calls run on several worker threads at once

    def __call__(self, items: list) -> list:
        """Features ``[tokens, text_hidden]`` (CPU) or None per item (``RemoteImage`` s)."""
        pending: list[DeploymentResponse | None] = []
        for im in items:
            ref = getattr(im, "pixels_ref", None)
            if ref is None:  # not a replica's item: nothing to send
                pending.append(None)
                continue
            call = EncodeCall(im.key, im.mode, ref, self.model)
            pending.append(self.handle.encode.remote(call))
        out: list[torch.Tensor | None] = []
        deadline = time.monotonic() + self.timeout
        for im, resp in zip(items, pending, strict=True):
            if resp is None:
                out.append(None)
                continue
            try:
                left = max(0.1, deadline - time.monotonic())
                got: FeatureRef = resp.result(timeout_s=left)
                if got.model != self.model:
                    raise ValueError("features of another model")
                out.append(ray.get(got.ref, timeout=max(0.1, deadline - time.monotonic())))
                with self._count:
                    self.fetched += 1
            except Exception as e:  # noqa: BLE001 - any failure: the replica's own tower
                resp.cancel()
                with self._count:
                    self.fallbacks += 1
                log.warning(
                    "image %s: no features from the encoders (%s); own tower",
                    im.key.hex(),
                    type(e).__name__,
                )
                out.append(None)
        return out
