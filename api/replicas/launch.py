"""``mmserve serve --replicas N``: start (or join) Ray, deploy the application, serve until
SIGTERM or Ctrl-C.

Ray Serve's HTTP proxy listens on ``--host``/``--port``; Ray itself starts on loopback
or is joined with ``--ray-address`` (:mod:`mmserve.fleet.deploy`, which also builds the
engine replica and encoder deployments the ingress is bound to here).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path

from api.settings import ServerSettings
from mmserve.config import EngineConfig
from mmserve.fleet.deploy import bind_fleet, init_ray_local, loopback_only
from mmserve.fleet.settings import ReplicaSettings

log = logging.getLogger(__name__)

#: Ray Serve application name of ``mmserve serve --replicas``.
APP_NAME = "mmserve"


def build_application(
    config: EngineConfig,
    server: ServerSettings,
    rs: ReplicaSettings,
    grace_seconds: float = 30.0,
):
    """The Ray Serve application: the ingress bound to ``rs.replicas`` engine replicas.

    Args:
        config: engine settings of every replica.
        server: HTTP settings of the ingress (its queue bound and health threshold also
            size the replicas).
        rs: replica count, resources, router and encoders.
        grace_seconds: how long a stopping ingress or replica lets running requests
            finish (the replicas' deployments: :func:`~mmserve.fleet.deploy.bind_fleet`).

    Raises:
        ValueError: for replica settings out of range.
    """
    from ray import serve

    from api.replicas.ingress import Ingress

    replicas, encoders = bind_fleet(
        config,
        rs,
        server.max_queued_requests,
        server.unhealthy_after_failed_steps,
        grace_seconds,
    )
    ingress = serve.deployment(Ingress, name="Ingress").options(
        num_replicas=1,
        ray_actor_options={"num_cpus": rs.ingress_cpus},
        max_ongoing_requests=100_000,
        graceful_shutdown_timeout_s=grace_seconds,
    )
    return ingress.bind(replicas, config, server, rs.replicas, encoders)


def serve_replicas(
    launch,
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
