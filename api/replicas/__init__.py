"""The HTTP side of ``mmserve serve --replicas N`` (the fleet itself is :mod:`mmserve.fleet`).

- :mod:`api.replicas.ingress`: the ingress deployment, the single-process server's
  FastAPI routes in front of the engine replicas, with fleet-wide health, stats,
  metrics and flush;
- :mod:`api.replicas.launch`: the CLI glue that starts (or joins) Ray, binds the
  ingress to the fleet's deployments and serves until SIGTERM or Ctrl-C;
- :mod:`mmserve.frontend.frontend`: the ingress's front end without weights.

Only the ingress imports Ray at import time (the CLI imports ``launch`` only for
``--replicas``/``--ray-address``), so the single-process server never loads it.
"""
