"""Several engine replicas behind one OpenAI-compatible endpoint, on Ray Serve.

``mmserve serve --replicas N`` (:mod:`api.replicas.launch`) starts a local Ray
instance on loopback, or joins a cluster with ``--ray-address``, and deploys an
application of two deployments:

- the **ingress** (:mod:`api.replicas.ingress`): the same FastAPI routes as the
  single-process server. It runs the front end once per request (decode, hash,
  template, tokenize, limits; :class:`~mmserve.frontend.frontend.FrontEnd`), puts each
  image's pixels in Ray's object store once, and sends the tokenized request to a
  replica (:class:`~api.replicas.client.ReplicaClient`);
- N **engine replicas** (:mod:`api.replicas.replica`), one engine each, which fetch
  an image's pixels only when their vision-embedding cache misses.

Requests are routed by :mod:`api.replicas.router`, a Ray Serve custom request
router that keeps an approximate radix tree of the token sequences sent to each
replica and picks the longest match unless the load is uneven.

Nothing here imports Ray at import time except the modules that need it
(``router``, ``replica``, ``client``, ``ingress``, ``launch``), so the
single-process server never loads it.
"""
