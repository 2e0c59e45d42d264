"""Host-memory and disk KV tiers behind the radix tree, keyed by content.

The radix tree (:mod:`mmserve.cache.radix_cache`) holds KV pages only while they
are in the device pool. The tiers keep pages the tree evicts, so a prefix the
pool lost (or a process that never computed it) can load its KV instead of
recomputing it, the way SGLang's HiCache (device -> host -> storage) does.

Three modules, one job each:

- :mod:`~mmserve.cache.kv_tiers.keys`: what names a page (in-memory model fingerprint, namespace,
  the XXH3-128 page key chain).
- :mod:`~mmserve.cache.kv_tiers.disk`: the disk tier (checked files, their format, the
  LRU index, the writer thread).
- :mod:`~mmserve.cache.kv_tiers.tiers`: the host tier and :class:`KVTiers`, the policy
  (write-back on eviction, lookup, loading, the feature tier).
"""

from mmserve.cache.kv_tiers.disk import HEADER_BYTES, RESCAN_SECONDS, DiskTier
from mmserve.cache.kv_tiers.keys import (
    FORMAT_VERSION,
    PageKeyChain,
    kv_namespace,
    model_fingerprint,
)
from mmserve.cache.kv_tiers.tiers import (
    LOADER_THREADS,
    FeatureCache,
    KVTiers,
    TierMatch,
    host_tier,
)

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "LOADER_THREADS",
    "RESCAN_SECONDS",
    "DiskTier",
    "FeatureCache",
    "KVTiers",
    "PageKeyChain",
    "TierMatch",
    "host_tier",
    "kv_namespace",
    "model_fingerprint",
]
