"""Ray for the fleet: a local instance on loopback, and the deployments of the engine
replicas and the vision encoders that ``mmserve serve --replicas N`` puts behind its
ingress (:mod:`api.replicas.launch` binds the ingress to them).

Locally, Ray starts on loopback only (``127.0.0.1``, dashboard off). On a cluster
(``ray start --head`` on one machine, ``ray start --address HEAD:6379`` on the others)
the replicas go wherever Ray finds the resources asked for (``--gpus-per-replica``,
``--cpus-per-replica``).
"""

from __future__ import annotations

import os
import sys

from mmserve.config import DEFAULT_MAX_TOTAL_TOKENS, EngineConfig
from mmserve.fleet.settings import ReplicaSettings

#: Extra in-flight calls a replica accepts beyond the engine's queue (control calls).
_CONTROL_SLACK = 16
#: With ``--kv-disk-dir``, the cache router's tree for the shared disk tier holds this
#: many replicas' trees' worth of tokens (sequences routed to any replica).
DISK_TREE_POOLS = 8


def loopback_only() -> None:
    """Make a Ray instance started by this process use and listen on 127.0.0.1 only.

    On Linux Ray replaces a loopback ``node_ip_address`` by the machine's routable
    address and its servers listen on every interface; with Ray's
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (single-machine mode) the node address is
    127.0.0.1 and GCS, raylet and workers listen there. Set in the environment, so
    the processes Ray starts inherit it.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    if "ray._private.ray_constants" in sys.modules:  # its constant was read at import
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False


def init_ray_local(num_cpus: int | None = None) -> None:
    """Start a local Ray instance on loopback, dashboard off (what ``--replicas`` does
    without ``--ray-address``; tests and the benchmark use it too)."""
    loopback_only()
    import ray

    ray.init(
        address="local",
        include_dashboard=False,
        num_cpus=num_cpus,
        _node_ip_address="127.0.0.1",
        configure_logging=False,
    )


def bind_fleet(
    config: EngineConfig,
    rs: ReplicaSettings,
    max_queued_requests: int,
    unhealthy_after: int,
    grace_seconds: float = 30.0,
):
    """The engine replica deployment bound to its arguments, and the encoder deployment
    (``rs.encoders``; None without), ready to be passed to an ingress's ``bind``.

    Args:
        config: engine settings of every replica (``model_path`` None: the bundled tiny
            model, built on each node that lacks it).
        rs: replica count, resources and router; encoders, each replica asking them for
            features before running its own tower.
        max_queued_requests: requests the ingress queues (a replica accepts that many
            calls beyond its running requests, plus control calls).
        unhealthy_after: engine steps failing in a row after which a replica reports
            itself unhealthy.
        grace_seconds: how long a stopping replica lets running requests finish; with
            the disk KV tier on it then has ``FLUSH_SECONDS`` more to write its pages.

    Raises:
        ValueError: for replica settings out of range.
    """
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from mmserve.fleet.replica import FLUSH_SECONDS, EngineReplica
    from mmserve.fleet.router import ROUTER_CLASSES

    rs.validate()
    tree_tokens = rs.router_max_tree_tokens or config.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS
    router = RequestRouterConfig(
        # Ray annotates RequestRouterConfig's **kwargs as dicts
        request_router_class=ROUTER_CLASSES[rs.replica_router],  # type: ignore[arg-type]
        request_router_kwargs={
            "cache_threshold": rs.router_cache_threshold,
            "balance_abs_threshold": rs.router_balance_abs_threshold,
            "balance_rel_threshold": rs.router_balance_rel_threshold,
            "max_tree_tokens": tree_tokens,
            # the shared disk tier holds far more than a pool: DISK_TREE_POOLS pools' worth
            "disk_tree_tokens": DISK_TREE_POOLS * tree_tokens if config.kv_disk_dir else 0,
        },
    )
    threads = max(1, int(rs.cpus_per_replica))
    # serve.deployment(name=...) then the class: what serve.deployment(cls, name=...) does,
    # in the form Ray's annotation describes
    replicas = serve.deployment(name="EngineReplica")(EngineReplica).options(
        num_replicas=rs.replicas,
        ray_actor_options=rs.actor_options(config.device, config.tp),
        max_ongoing_requests=max_queued_requests + config.max_running_requests + _CONTROL_SLACK,
        request_router_config=router,
        health_check_period_s=5.0,
        health_check_timeout_s=60.0,
        graceful_shutdown_timeout_s=grace_seconds + (FLUSH_SECONDS if config.kv_disk_dir else 0),
    )
    encoders = None
    if rs.encoders:
        from mmserve.fleet.encoder import KeyAffinityRouter, VisionEncoder

        encoders = (
            serve.deployment(name="VisionEncoder")(VisionEncoder)
            .options(
                num_replicas=rs.encoders,
                ray_actor_options=rs.encoder_options(config.device),
                max_ongoing_requests=1024,
                request_router_config=RequestRouterConfig(
                    request_router_class=KeyAffinityRouter  # type: ignore[arg-type]  # as above
                ),
                health_check_period_s=5.0,
            )
            .bind(config, max(1, int(rs.cpus_per_encoder)), rs.encoder_cache_bytes)
        )
    return replicas.bind(config, threads, unhealthy_after, encoders), encoders
