"""Request fields about the prefix cache: ``cache_salt`` (vLLM's), ``prompt_cache_key``
and ``prompt_cache_retention`` (OpenAI's), and the effective salt of a request.

A request's effective salt (:func:`effective_salt`) is its tenant's (api/tenants.py;
none with ``--shared-cache`` or a single key) combined with its own ``cache_salt``:
requests with different effective salts share no cached state
(:mod:`mmserve.cache.salt`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from api.tenants import DEFAULT_TENANT, current_tenant
from mmserve.cache.salt import MAX_SALT_CHARS, combine

#: Most characters of a ``prompt_cache_key`` (OpenAI documents no bound; 64 is its
#: ``user``-like identifiers' size, with room).
MAX_PROMPT_CACHE_KEY_CHARS = 256


class CacheSaltField(BaseModel):
    """``cache_salt``: requests with different salts share no cached state."""

    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_SALT_CHARS,
        description="requests with different salts share no cached prefix, image "
        "features or tier pages; the same salt shares as no salt does",
    )


class PromptCacheFields(CacheSaltField):
    """OpenAI's ``prompt_cache_key`` (replica affinity under ``--replicas``) and
    ``prompt_cache_retention`` (``24h``: the prefix is written through to the disk tier)."""

    prompt_cache_key: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_PROMPT_CACHE_KEY_CHARS,
        description="requests with the same key go to the same replica while it is healthy",
    )
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        default=None,
        description="in_memory (default): the usual cache; 24h: also written to the disk tier",
    )


def effective_salt(cache_salt: str | None, shared_cache: bool) -> str:
    """The salt a request's engine requests carry: its tenant's (the current one,
    :func:`api.tenants.current_tenant`, set by the key check or a batch's owner; none
    with ``shared_cache`` or for the ``default`` tenant) combined with its own
    ``cache_salt``. ``""``: unsalted (today's keys, bit for bit)."""
    tenant = current_tenant()
    own = None if shared_cache or tenant == DEFAULT_TENANT else tenant
    return combine(own, cache_salt)
