"""Request fields about the prefix cache: ``cache_salt`` (vLLM's), ``prompt_cache_key``
and ``prompt_cache_retention`` (OpenAI's), and the effective salt of a request.

A request's effective salt (:func:`effective_salt`) is its tenant's (api/tenants.py;
none with ``--shared-cache`` or a single key) combined with its own ``cache_salt``:
requests with different effective salts share no cached state
(:mod:`mmserve.cache.salt`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from pydantic import BaseModel, Field

from api.errors import APIError
from api.tenants import DEFAULT_TENANT, current_tenant
from mmserve.cache.salt import MAX_SALT_CHARS, combine
from mmserve.types import EngineRequest

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


def cache_options(body: PromptCacheFields, kv_disk_dir: str | None) -> dict[str, str]:
    """The :class:`~mmserve.types.EngineRequest` fields ``body``'s ``prompt_cache_key``
    and ``prompt_cache_retention`` give (``dataclasses.replace`` them in).

    Raises:
        APIError: 400 naming ``prompt_cache_retention`` for ``"24h"`` on a server
            without a disk KV tier (``--kv-disk-dir``): nothing would keep the prefix.
    """
    retention = body.prompt_cache_retention or ""
    if retention == "24h" and not kv_disk_dir:
        raise APIError(
            400,
            'prompt_cache_retention: "24h" needs the disk KV tier, and this server has none '
            '(start it with --kv-disk-dir); send "in_memory" or leave it out',
            param="prompt_cache_retention",
        )
    return {
        "prompt_cache_key": body.prompt_cache_key or "",
        "prompt_cache_retention": retention,
    }


def with_cache_options(reqs: list[EngineRequest], options: dict[str, str]) -> list[EngineRequest]:
    """``reqs`` carrying ``options`` (:func:`cache_options`); the same list when empty."""
    if not any(options.values()):
        return reqs
    return [replace(r, **options) for r in reqs]
