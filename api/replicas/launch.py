"""``mmserve serve --replicas N``: start (or join) Ray, deploy the application, serve until
SIGTERM or Ctrl-C.

Locally, Ray starts on loopback only (``127.0.0.1``, dashboard off) and Ray Serve's
HTTP proxy listens on ``--host``/``--port``. With ``--ray-address`` the application
is deployed on an existing cluster (``ray start --head`` on one machine, ``ray start
--address HEAD:6379`` on the others); its replicas go wherever Ray finds the
resources asked for (``--gpus-per-replica``, ``--cpus-per-replica``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

from api.replicas.settings import ReplicaSettings
from api.settings import ServerSettings
from mmserve.config import DEFAULT_MAX_TOTAL_TOKENS, EngineConfig

log = logging.getLogger(__name__)

#: Ray Serve application name of ``mmserve serve --replicas``.
APP_NAME = "mmserve"
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
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # ray imported already: its constant was read at import
        constants.ENABLE_RAY_CLUSTER = False


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


def build_application(
    config: EngineConfig,
    server: ServerSettings,
    rs: ReplicaSettings,
    grace_seconds: float = 30.0,
):  # noqa: ANN201 - ray.serve.Application
    """The Ray Serve application: the ingress bound to ``rs.replicas`` engine replicas.

    Args:
        config: engine settings of every replica (``model_path`` None: the bundled tiny
            model, built on each node that lacks it).
        server: HTTP settings of the ingress.
        rs: replica count, resources and router; encoders (``rs.encoders``), each
            replica asking them for features before running its own tower.
        grace_seconds: how long a stopping replica lets running requests finish; with
            the disk KV tier on it then has ``FLUSH_SECONDS`` more to write its pages.
    """
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from api.replicas.ingress import Ingress
    from api.replicas.replica import FLUSH_SECONDS, EngineReplica
    from api.replicas.router import ROUTER_CLASSES

    rs.validate()
    tree_tokens = rs.router_max_tree_tokens or config.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS
    router = RequestRouterConfig(
        request_router_class=ROUTER_CLASSES[rs.replica_router],
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
    replicas = serve.deployment(EngineReplica, name="EngineReplica").options(
        num_replicas=rs.replicas,
        ray_actor_options=rs.actor_options(config.device, config.tp),
        max_ongoing_requests=(
            server.max_queued_requests + config.max_running_requests + _CONTROL_SLACK
        ),
        request_router_config=router,
        health_check_period_s=5.0,
        health_check_timeout_s=60.0,
        graceful_shutdown_timeout_s=grace_seconds + (FLUSH_SECONDS if config.kv_disk_dir else 0),
    )
    ingress = serve.deployment(Ingress, name="Ingress").options(
        num_replicas=1,
        ray_actor_options={"num_cpus": rs.ingress_cpus},
        max_ongoing_requests=100_000,
        graceful_shutdown_timeout_s=grace_seconds,
    )
    encoders = None
    if rs.encoders:
        from api.replicas.encoder import KeyAffinityRouter, VisionEncoder

        encoders = (
            serve.deployment(VisionEncoder, name="VisionEncoder")
            .options(
                num_replicas=rs.encoders,
                ray_actor_options=rs.encoder_options(config.device),
                max_ongoing_requests=1024,
                request_router_config=RequestRouterConfig(request_router_class=KeyAffinityRouter),
                health_check_period_s=5.0,
            )
            .bind(config, max(1, int(rs.cpus_per_encoder)), rs.encoder_cache_bytes)
        )
    app = replicas.bind(config, threads, server.unhealthy_after_failed_steps, encoders)
    return ingress.bind(app, config, server, rs.replicas, encoders)


def serve_replicas(
    launch,  # noqa: ANN001 - api.cli.LaunchSettings
    config: EngineConfig,
    server: ServerSettings,
    rs: ReplicaSettings,
) -> int:
    """Run ``mmserve serve`` on Ray Serve until SIGTERM/SIGINT; returns the exit status.

    Args:
        launch: :class:`api.cli.LaunchSettings` (host, port, grace period, log level).
        config: the replicas' engine settings.
        server: the ingress's HTTP settings.
        rs: replica count, resources, router, Ray address.
    """
    if not rs.ray_address:
        loopback_only()
    if config.model_path and Path(config.model_path).exists():
        # replicas and the ingress run in other processes (other machines: same path)
        config.model_path = str(Path(config.model_path).resolve())
    try:
        import ray
        from ray import serve
    except ImportError:
        print(
            "mmserve serve: error: --replicas and --ray-address need Ray Serve: "
            'pip install -e ".[replicas]"',
            file=sys.stderr,
        )
        return 2
    if rs.ray_address:
        ray.init(address=rs.ray_address, configure_logging=False)
    else:
        init_ray_local()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        level = {"trace": "debug"}.get(launch.log_level, launch.log_level).upper()
        logging_config = {"log_level": level}
        serve.start(
            proxy_location="HeadOnly",
            http_options={"host": launch.host, "port": launch.port},
            logging_config=logging_config,
        )
        app = build_application(config, server, rs, launch.shutdown_grace_seconds)
        serve.run(app, name=APP_NAME, route_prefix="/", logging_config=logging_config)
        print(
            f"mmserve: {rs.replicas} replica(s), router {rs.replica_router}, serving on "
            f"http://{launch.host}:{launch.port}",
            flush=True,
        )
        while not stop.wait(1.0):
            pass
    finally:
        try:
            # deleting the application first waits (up to 60 s) for the replicas to drain
            # and write their KV pages to the disk tier; serve.shutdown waits only 30 s
            try:
                serve.delete(APP_NAME)  # other applications on the cluster keep running
            except TimeoutError:
                log.warning("replicas still stopping after 60 s; shutting down anyway")
            if not rs.ray_address:
                serve.shutdown()
        finally:
            ray.shutdown()
    return 0
