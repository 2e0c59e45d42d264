"""The fleet: several engine replicas behind one endpoint, on Ray Serve.

``mmserve serve --replicas N`` deploys an application of two (three with
``--encoders``) deployments; this package holds everything but the HTTP ingress
(:mod:`api.replicas.ingress`, bound to the rest by :mod:`api.replicas.launch`):

- the **engine replicas** (:mod:`mmserve.fleet.replica`), one engine each, which
  receive tokenized requests (:mod:`mmserve.fleet.protocol`) and fetch an image's
  pixels from Ray's object store only when their vision-embedding cache misses;
- the **client** the ingress streams from (:mod:`mmserve.fleet.client`): it puts each
  image's pixels in the object store once, sends requests and control calls through
  the Ray Serve handle, and retries a request whose replica died;
- the **request routers** (:mod:`mmserve.fleet.router`), Ray Serve custom routers;
  the cache router keeps an approximate radix tree (:mod:`mmserve.fleet.prefix_tree`)
  of the token sequences sent to each replica and picks the longest match unless the
  load is uneven; :mod:`mmserve.fleet.registry` lets the ingress find them;
- the shared **vision encoders** (:mod:`mmserve.fleet.encoder`, ``--encoders N``);
- the settings (:mod:`mmserve.fleet.settings`) and the deployments with their Ray
  start-up (:mod:`mmserve.fleet.deploy`).

Nothing here imports Ray at import time except the modules that need it
(``router``, ``replica``, ``client``, ``encoder``), so the single-process server never
loads it; nothing here imports the HTTP layer (``api``).
"""
