"""Where the request routers Ray Serve builds in this process can be found by the ingress.

Ray Serve pickles a custom router's module by value and rebuilds its classes in the
process that holds the deployment handle, so the router module's own globals are
copies; this module is imported normally (by reference) on both sides.
"""

from __future__ import annotations

import threading

_ROUTERS: dict[tuple[str, str], object] = {}
_LOCK = threading.Lock()


def register(app_name: str, deployment: str, router: object) -> None:
    """Record the router of ``deployment`` in ``app_name`` (the latest one wins)."""
    with _LOCK:
        _ROUTERS[(app_name, deployment)] = router


def find_router(app_name: str, deployment: str):
    """The router registered for ``deployment`` of ``app_name``, or None."""
    with _LOCK:
        return _ROUTERS.get((app_name, deployment))
