"""What the ingress sends to a replica and what comes back.

A :class:`ReplicaRequest` is a tokenized request: token ids (text ids and image
pseudo-ids), one :class:`SpanRef` per image run with the image's key and a
reference to its pixels in Ray's object store, and the sampling parameters. The
router reads its ``input_ids``; the replica rebuilds an engine
:class:`~mmserve.engine.request.Request` from it. A :class:`ControlCall` asks one
replica (``target``) for its stats, a flush or its health.

Replies of :meth:`~mmserve.fleet.replica.EngineReplica.generate` are
:class:`Hello` (which replica serves the request), then the engine's own
:class:`~mmserve.types.TokenDelta` messages (new token ids and logprobs,
the last with the finish reason); the ingress builds text and results from them
exactly as a single-process server does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmserve.types import SamplingParams


@dataclass
class SpanRef:
    """One image run of a prompt: positions ``[start, start + length)``.

    Attributes:
        start: first position.
        length: pseudo-tokens of the run.
        key: the item's content key (what the embedding cache is keyed by).
        mode: how the family encodes it (``ImageInput.mode``).
        pixels: ``ray.ObjectRef`` of the item's preprocessed tower input
            (:class:`~mmserve.vision.pixels.Pixels`), put once by the ingress.
        modality: ``ImageSpan.modality`` ("image" or "video", for usage counts).
    """

    start: int
    length: int
    key: bytes
    mode: str
    pixels: Any
    modality: str = "image"


@dataclass
class ReplicaRequest:
    """A tokenized request for one replica.

    Attributes:
        rid: request id (the ingress's; results and errors name it).
        input_ids: prompt token ids, image pseudo-ids included.
        spans: the image runs.
        params: sampling parameters (a constrained request's grammar is compiled again
            on the replica from ``params.guided``).
        avoid: unique id of a replica not to use (it died serving this request).
        priority: the engine request's scheduling class (batch-job lines run at
            ``BACKGROUND`` on the replica too).
        model: identity of the model the ids were made for
            (:func:`~mmserve.model.identity.checkpoint_identity` of the ingress's checkpoint,
            dtype and quantization); the cache router matches and records prefixes under it
            only, so a prefix routed for one checkpoint never predicts a hit for another.
    """

    rid: str
    input_ids: list[int]
    spans: list[SpanRef]
    params: SamplingParams
    avoid: str | None = None
    priority: int = 0
    model: bytes = b""
    cache_salt: str = ""
    prompt_cache_key: str = ""
    prompt_cache_retention: str = ""


#: Kinds of :class:`ControlCall`.
CONTROL_KINDS = ("ping", "stats", "flush", "health")


@dataclass
class ControlCall:
    """A call for one replica: ``kind`` in :data:`CONTROL_KINDS`.

    Attributes:
        kind: what to do.
        target: unique id of the replica that must answer (None: any replica).
    """

    kind: str
    target: str | None = None


@dataclass
class Hello:
    """First reply of a generation: who serves it.

    Attributes:
        replica: the replica's unique id.
        pid: its process id.
    """

    replica: str
    pid: int
