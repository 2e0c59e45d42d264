"""Settings of a multi-replica deployment (``mmserve serve --replicas N``)."""

from __future__ import annotations

from dataclasses import dataclass

#: Request routers a deployment can use (``--replica-router``).
ROUTERS = ("cache", "pow2", "round_robin")


@dataclass
class ReplicaSettings:
    """Several engine replicas on Ray Serve behind one endpoint.

    Attributes:
        replicas: engine replicas behind one endpoint; 1 without --ray-address is the
            single-process server (no Ray), more starts a local Ray instance on loopback
            (dashboard off) and deploys them.
        ray_address: join this Ray cluster ("auto", or the head's HOST:6379 as printed by
            `ray start --head`) instead of starting a local instance; works with any
            --replicas, 1 included.
        gpus_per_replica: GPUs Ray reserves for each replica (fractions share a GPU;
            None: 1 with --device cuda, else 0).
        cpus_per_replica: CPUs Ray reserves for each replica (fractions allowed); the
            replica's torch threads are this rounded down, at least 1.
        ingress_cpus: CPUs Ray reserves for the ingress (front end and HTTP routes).
        replica_router: how requests are sent to replicas: cache (longest prefix of the
            token sequence, images included, unless the load is uneven), pow2 (Ray Serve's
            default power-of-two-choices) or round_robin.
        router_cache_threshold: cache router: route by prefix when the best replica
            already holds at least this fraction of the prompt's tokens, else to the
            least-loaded replica.
        router_balance_abs_threshold: cache router: the load (requests in flight from
            this ingress) is uneven when the busiest replica has more than this many
            requests above the idlest...
        router_balance_rel_threshold: ...and more than this many times its load; then
            requests go to the least-loaded replica.
        router_max_tree_tokens: cache router: tokens kept per replica in its approximate
            radix tree, least recently used trimmed first (None: --max-total-tokens, the
            size of a replica's KV pool).
        encoders: vision encoder replicas (tower and projector only) shared by every
            engine replica: an image is encoded once for the whole deployment, its
            features kept in Ray's object store under the image key; 0: each replica
            runs its own tower.
        gpus_per_encoder: GPUs Ray reserves for each encoder (None: 1 with --device cuda,
            else 0).
        cpus_per_encoder: CPUs Ray reserves for each encoder; its torch threads are this
            rounded down, at least 1.
        encoder_cache_bytes: feature bytes each encoder keeps referenced in the object
            store, least recently used released first.
    """

    replicas: int = 1
    ray_address: str | None = None
    gpus_per_replica: float | None = None
    cpus_per_replica: float = 1.0
    ingress_cpus: float = 0.0
    replica_router: str = "cache"
    router_cache_threshold: float = 0.5
    router_balance_abs_threshold: int = 16
    router_balance_rel_threshold: float = 1.5
    router_max_tree_tokens: int | None = None
    encoders: int = 0
    gpus_per_encoder: float | None = None
    cpus_per_encoder: float = 1.0
    encoder_cache_bytes: int = 1 << 30

    @property
    def uses_ray(self) -> bool:
        """Whether these settings run the server on Ray Serve."""
        return self.replicas > 1 or bool(self.ray_address)

    def gpus(self, device: str) -> float:
        """GPUs per replica: ``gpus_per_replica``, else 1 on a CUDA device and 0 otherwise."""
        if self.gpus_per_replica is not None:
            return self.gpus_per_replica
        return 1.0 if device.startswith("cuda") else 0.0

    def actor_options(self, device: str, tp: int = 1) -> dict[str, float]:
        """Ray actor resources of one replica running ``tp`` tensor-parallel ranks:
        ``tp`` times one rank's CPUs and GPUs, in the one actor (so on one node). The
        worker ranks are the actor's child processes on 127.0.0.1 and see only the GPUs
        in its ``CUDA_VISIBLE_DEVICES``, so ``tp`` one-GPU bundles, of which the actor
        would get the first only, would leave them without a device."""
        return {"num_cpus": self.cpus_per_replica * tp, "num_gpus": self.gpus(device) * tp}

    def encoder_options(self, device: str) -> dict[str, float]:
        """Ray actor resources of one encoder."""
        gpus = self.gpus_per_encoder
        if gpus is None:
            gpus = 1.0 if device.startswith("cuda") else 0.0
        return {"num_cpus": self.cpus_per_encoder, "num_gpus": gpus}

    def validate(self) -> None:
        """Raises ValueError for a setting out of range."""
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        for name in ("cpus_per_replica", "ingress_cpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.gpus_per_replica is not None and self.gpus_per_replica < 0:
            raise ValueError(f"gpus_per_replica must be >= 0, got {self.gpus_per_replica}")
        if self.replica_router not in ROUTERS:
            raise ValueError(f"replica_router must be one of {', '.join(ROUTERS)}")
        if not 0 <= self.router_cache_threshold <= 1:
            raise ValueError("router_cache_threshold must be in [0, 1]")
        if self.router_balance_abs_threshold < 0 or self.router_balance_rel_threshold < 1:
            raise ValueError(
                "router_balance_abs_threshold must be >= 0 and router_balance_rel_threshold >= 1"
            )
        if self.router_max_tree_tokens is not None and self.router_max_tree_tokens < 1:
            raise ValueError("router_max_tree_tokens must be >= 1")
        if self.encoders < 0:
            raise ValueError(f"encoders must be >= 0, got {self.encoders}")
        if self.encoders and not self.uses_ray:
            raise ValueError("encoders need --replicas > 1 or --ray-address")
        if self.cpus_per_encoder < 0 or (self.gpus_per_encoder or 0) < 0:
            raise ValueError("cpus_per_encoder and gpus_per_encoder must be >= 0")
        if self.encoder_cache_bytes < 1:
            raise ValueError(f"encoder_cache_bytes must be >= 1, got {self.encoder_cache_bytes}")
