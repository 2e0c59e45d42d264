"""Cache salts: requests with different salts share no cached state.

A salt (``cache_salt``, a tenant, or both: :func:`combine`) becomes a 64-bit namespace
(:func:`namespace`, blake2b of the salt). Inside one namespace every cache keys as it
does unsalted, so the same salt shares exactly as no salt does; across namespaces:

- image content keys are re-keyed (:func:`salted_image_key`) before their pseudo-ids
  are derived, so image features (the embedding cache, the encoder deployment's cache,
  the disk tier's feature files) and image pseudo-ids differ;
- the token keys the radix tree, the host/disk KV tiers (whose page keys hash the tree's
  keys) and the replica router's prefix tree match on are mapped token by token through a
  keyed bijection of int64 (:func:`salted_ids`): a salted key never equals an unsalted
  one (text ids are ``>= 0``, salted ids negative) and two namespaces agree on a whole page
  only by a 64-bit collision.

The empty salt is namespace 0: no mapping at all (today's behaviour, bit for bit).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

#: Most characters of a ``cache_salt`` (vLLM does not bound it; a salt is an opaque tag).
MAX_SALT_CHARS = 256

_NS_DOMAIN = b"mmserve-cache-salt-v1\x00"
_KEY_DOMAIN = b"mmserve-salted-image-key-v1\x00"
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def combine(tenant: str | None, salt: str | None) -> str:
    """The effective salt of a request: its tenant's (None with ``--shared-cache``) and
    its own ``cache_salt``, so two tenants sending the same ``cache_salt`` still differ.
    Empty when neither is set."""
    if not tenant:
        return salt or ""
    return f"tenant:{tenant}\x00{salt or ''}"


def namespace(salt: str) -> int:
    """The 64-bit namespace of ``salt`` (0 for ``""``: unsalted).

    Returns:
        a nonzero unsigned 64-bit int (blake2b-64 of the salt) or 0.
    """
    if not salt:
        return 0
    d = hashlib.blake2b(_NS_DOMAIN + salt.encode(), digest_size=8).digest()
    return int.from_bytes(d, "little") or 1


def salted_image_key(key: bytes, salt: str) -> bytes:
    """``key`` (16 bytes) re-keyed under ``salt`` (itself when ``salt`` is empty)."""
    if not salt:
        return key
    return hashlib.blake2b(_KEY_DOMAIN + salt.encode() + b"\x00" + key, digest_size=16).digest()


def salted_ids(ids: Sequence[int], ns: int) -> list[int]:
    """``ids`` (int64 token or pseudo-token ids) as cache keys in namespace ``ns``.

    Each id goes through splitmix64's finalizer (a bijection of 64-bit words) after an
    xor with ``ns``, then into ``[-2**63, -1]``: distinct ids stay distinct up to a 2**-63
    chance, order and length are kept (so page boundaries are the same). ``ns == 0``
    returns ``ids`` unchanged (as a list).
    """
    if not ns:
        return list(ids)
    if not ids:
        return []
    x = np.asarray(ids, dtype=np.int64).view(np.uint64) ^ np.uint64(ns)
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    x = x ^ (x >> np.uint64(31))
    # top bit set: negative as int64, so never a text id of an unsalted key
    x = x | np.uint64(1 << 63)
    return x.view(np.int64).tolist()
