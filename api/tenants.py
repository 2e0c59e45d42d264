"""Tenants: one API key per tenant (``--api-keys FILE``), the caller's tenant for the
request, and ownership of stored objects.

The file has one ``key tenant`` per line (blank lines and ``#`` comments skipped); it is
read at start (a malformed line refuses to start, naming the line) and again on SIGHUP
(a bad file then keeps the old keys and logs one line). ``--api-key`` alone is one
tenant, ``default``, as is a server without keys.

Every request's tenant is set by the key check (:class:`api.auth.APIKeyMiddleware`) on
``request.state.tenant`` and in :data:`CURRENT_TENANT` (a context variable the handlers
and their worker threads see). Each tenant's requests carry the tenant as their cache
salt unless ``--shared-cache`` (:func:`api.cache_fields.effective_salt`), and uploads,
files and batches belong to the tenant that made them: another tenant gets 404, and
listings show only one's own.
"""

from __future__ import annotations

import hmac
import logging
import re
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("mmserve.tenants")

#: The tenant of a request when the server has one key or none.
DEFAULT_TENANT = "default"

#: The caller's tenant (set per request by the key check; batch lines set their owner's).
CURRENT_TENANT: ContextVar[str] = ContextVar("mmserve_tenant", default=DEFAULT_TENANT)

#: A tenant name: letters, digits and ``._-@``, 1..64 characters.
_TENANT = re.compile(r"[A-Za-z0-9._@-]{1,64}")
#: Shortest key accepted in the file (a short key is guessable).
MIN_KEY_CHARS = 8


class TenantFileError(ValueError):
    """A malformed ``--api-keys`` file; the message names the file and the line."""


def parse_keys(text: str, source: str = "--api-keys") -> dict[str, str]:
    """``key -> tenant`` from the file's ``text``.

    Raises:
        TenantFileError: a line without exactly two fields, a key shorter than
            :data:`MIN_KEY_CHARS`, a tenant name outside ``[A-Za-z0-9._@-]{1,64}``, a key
            given twice, or no key at all; the message names ``source`` and the line.
    """
    keys: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        where = f"{source} line {n}"
        if len(parts) != 2:
            raise TenantFileError(f"{where}: expected 'KEY TENANT', got {len(parts)} fields")
        key, tenant = parts
        if len(key) < MIN_KEY_CHARS:
            raise TenantFileError(f"{where}: the key is shorter than {MIN_KEY_CHARS} characters")
        if not _TENANT.fullmatch(tenant):
            raise TenantFileError(
                f"{where}: tenant {tenant[:64]!r} must be 1-64 of letters, digits and ._@-"
            )
        if key in keys:
            raise TenantFileError(f"{where}: this key is already given on an earlier line")
        keys[key] = tenant
    if not keys:
        raise TenantFileError(f"{source}: no 'KEY TENANT' line")
    return keys


@dataclass
class TenantKeys:
    """The keys the server accepts and whose tenant each is.

    Attributes:
        keys: ``(key bytes, tenant)`` pairs.
        path: the ``--api-keys`` file (None: one ``--api-key``, tenant ``default``).
    """

    keys: list[tuple[bytes, str]]
    path: Path | None = None

    @classmethod
    def single(cls, key: str) -> TenantKeys:
        """One key, the ``default`` tenant (``--api-key``)."""
        return cls([(key.encode(), DEFAULT_TENANT)])

    @classmethod
    def from_file(cls, path: str | Path) -> TenantKeys:
        """Read ``path``.

        Raises:
            TenantFileError: the file cannot be read or is malformed (see :func:`parse_keys`).
        """
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TenantFileError(f"--api-keys {p}: cannot read: {e}") from None
        pairs = parse_keys(text, f"--api-keys {p}")
        return cls([(k.encode(), t) for k, t in pairs.items()], p)

    @property
    def tenants(self) -> int:
        """How many distinct tenants (the metrics' gauge; no names leave the server)."""
        return len({t for _, t in self.keys})

    def lookup(self, token: bytes) -> str | None:
        """The tenant of ``token``, or None. Compared against every key in constant
        time each (``hmac.compare_digest``), whichever matches, so the time says nothing
        about which key or how much of one matched."""
        found = None
        for key, tenant in self.keys:
            if hmac.compare_digest(token, key):
                found = tenant
        return found

    def reload(self) -> bool:
        """Read the file again (SIGHUP); on error keep the old keys and log one line.

        Returns:
            whether the keys were replaced.
        """
        if self.path is None:
            return False
        try:
            fresh = TenantKeys.from_file(self.path)
        except TenantFileError as e:
            log.error("api keys not reloaded, the old keys stay: %s", e)
            return False
        self.keys = fresh.keys
        log.info("api keys reloaded from %s: %d tenants", self.path, self.tenants)
        return True


def current_tenant() -> str:
    """The tenant of the request being handled (``default`` outside one)."""
    return CURRENT_TENANT.get()


def owned_by(obj_owner: str | None, tenant: str | None = None) -> bool:
    """Whether an object recorded with ``obj_owner`` belongs to ``tenant`` (default: the
    current one). An object recorded before tenants existed (None) is the default
    tenant's."""
    return (obj_owner or DEFAULT_TENANT) == (tenant or current_tenant())
