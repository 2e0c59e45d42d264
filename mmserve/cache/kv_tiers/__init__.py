"""Host-memory and disk KV tiers behind the radix tree, keyed by content (being split)."""

from mmserve.cache.kv_tiers.disk import (
    FORMAT_VERSION,
    HEADER_BYTES,
    LOADER_THREADS,
    RESCAN_SECONDS,
    DiskTier,
    KVTiers,
    PageKeyChain,
    TierMatch,
    host_tier,
    kv_namespace,
    model_fingerprint,
)

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "LOADER_THREADS",
    "RESCAN_SECONDS",
    "DiskTier",
    "KVTiers",
    "PageKeyChain",
    "TierMatch",
    "host_tier",
    "kv_namespace",
    "model_fingerprint",
]
