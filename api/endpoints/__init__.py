"""One handler per POST endpoint (check, prepare, answer), called by its route and by the
batch runner (:mod:`api.batch.runner`) alike; never by importing a route module."""

from __future__ import annotations

from api.endpoints.base import Endpoint
from api.endpoints.chat import CHAT
from api.endpoints.responses import RESPONSES

#: The handler of each endpoint a batch may target, by its URL path.
HANDLERS: dict[str, Endpoint] = {h.path: h for h in (CHAT, RESPONSES)}

__all__ = ["HANDLERS", "Endpoint"]
