"""The host tier and :class:`KVTiers`: the policy that moves pages between the device pool,
host memory and disk.

**Write policy: write-back on eviction.** When the tree evicts a node, its pages
are copied to the host tier (synchronously, before the pool pages are reused)
and queued for the disk writer thread (skipped when the disk already has that
key). The host tier is a byte-bounded LRU that simply drops its least recently
used pages (the disk has them). On shutdown (:meth:`KVTiers.flush_tree`) every
page still in the tree goes to disk, so a restarted process finds them. Loaded
pages re-enter the tree and are not written again (the key is on disk already).

**Loading.** :meth:`KVTiers.lookup` walks the chain past the device match and
reports how many pages are in host memory and how many more are on disk. Host
pages are copied into the pool at once. Disk pages are read by a loader thread
into a staging area; meanwhile the request waits ("loading") and the engine
keeps running other batches; once loaded, the pages are taken from staging like
host pages.

**Feature tier.** Whole pages cannot hold an image's last partial page, so a
question about a seen image recomputes those positions, which needs the image's
projected features. The tower's output is therefore written too (write-through: at
``[tokens, hidden]`` it is ``2 L Hkv D / hidden`` times smaller than the image's KV, 64x
for LLaVA-7B, 7x for a OneVision-0.5B shape), one file per image key in the same
namespace directory. When admission finds that a request's
image reaches past the pages the tree and tiers hold, and its features are neither in
the embedding cache nor in the request, the loader thread reads them with the pages and
:meth:`KVTiers.poll` puts them into the embedding cache, so the tower does not run
(after a restart, or once the embedding cache dropped them).

Page keys come from :mod:`mmserve.cache.kv_tiers.keys`; the files from
:mod:`mmserve.cache.kv_tiers.disk`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import xxhash

from mmserve.cache.kv_pool import KVPool
from mmserve.cache.kv_tiers.disk import DiskTier
from mmserve.cache.kv_tiers.keys import PageKeyChain
from mmserve.lru import LRU

log = logging.getLogger(__name__)

#: Threads reading pages from disk: one slow read does not hold up other requests' loads.
LOADER_THREADS = 4


def host_tier(capacity_bytes: int, page_bytes: int) -> LRU[bytes, torch.Tensor]:
    """The host tier: page tensors in host memory (pinned when the pool is on CUDA) in an
    :class:`~mmserve.lru.LRU` bounded at ``capacity_bytes``, every page counted as
    ``page_bytes`` (all pages have the same shape). A capacity below one page holds nothing.
    """
    return LRU(max_bytes=capacity_bytes, size=lambda _page: page_bytes)


def host_buffer(shape: Sequence[int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor, page-locked when ``pin`` (the pool is on CUDA: a
    copy from it to the device can be asynchronous). The one place host page buffers are
    allocated (tests put a stand-in for pinning here on the CPU)."""
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=pin)


class FeatureCache(Protocol):
    """Where features read from disk go (the engine's
    :class:`~mmserve.vision.embedding_cache.EmbeddingCache`)."""

    def __contains__(self, key: bytes) -> bool: ...

    def put(self, key: bytes, feats: torch.Tensor) -> object: ...


@dataclass
class TierMatch:
    """Pages past the device match found in the tiers (:meth:`KVTiers.lookup`).

    Attributes:
        keys: chain keys of the consecutive pages found, in order.
        host_pages: how many leading ``keys`` are in host memory (or staged from disk).
        disk_pages: how many following ``keys`` need a disk read first (some may be in
            host memory too; only the disk-only ones are read).
    """

    keys: list[bytes] = field(default_factory=list)
    host_pages: int = 0
    disk_pages: int = 0


class KVTiers:
    """Host and disk tiers for one KV pool (see the module docstring for the policy).

    Engine-thread methods: :meth:`on_evict`, :meth:`lookup`, :meth:`take`, :meth:`start_load`,
    :meth:`poll`, :meth:`flush_tree`. The loader thread only reads files and hands results
    back through a locked list.

    Args:
        pool: the KV pool pages are copied from and loaded into.
        namespace: :func:`kv_namespace` of the model, dtype, page size and layout.
        host_bytes: host tier capacity (bytes; 0 = off).
        disk_dir: disk tier directory (None = off).
        disk_bytes: disk tier capacity (bytes of files, pages and features together).
        feature_dim: the decoder's hidden size (width of an image's projected features;
            0 = no feature files).
        feature_cache: where features read from disk go (the engine's
            :class:`~mmserve.vision.embedding_cache.EmbeddingCache`: ``put(key, tensor)``
            and ``key in cache``); None = no feature files.
    """

    def __init__(
        self,
        pool: KVPool,
        namespace: bytes,
        host_bytes: int = 0,
        disk_dir: str | None = None,
        disk_bytes: int = 16 << 30,
        feature_dim: int = 0,
        feature_cache: FeatureCache | None = None,
    ) -> None:
        self.pool = pool
        self.feature_dim = feature_dim
        self.feature_cache = feature_cache
        self.page_size = pool.page_size
        self.chain = PageKeyChain(namespace, pool.page_size)
        k = pool.k_buffers[0]
        self.page_shape = (2, pool.num_layers, *k.shape[1:])
        self.page_bytes = int(np.prod(self.page_shape)) * k.element_size()
        self.pin = k.device.type == "cuda"
        self.host = host_tier(host_bytes, self.page_bytes)
        self.disk = (
            DiskTier(disk_dir, namespace, disk_bytes, self.page_shape, k.dtype)
            if disk_dir is not None
            else None
        )
        # pages read from disk for a waiting request, taken at its admission; bounded by
        # the pool's size (least recently staged dropped beyond it)
        self._staged: LRU[bytes, torch.Tensor] = LRU(max_items=pool.num_pages)
        # (request id, pages read, features read, seconds) of finished disk loads
        self._done: list[
            tuple[str, list[tuple[bytes, torch.Tensor]], list[tuple[bytes, torch.Tensor]], float]
        ] = []
        self._done_lock = threading.Lock()
        self._done_event = threading.Event()
        self._jobs: set[str] = set()  # request ids whose disk load is in flight
        self._tried: set[str] = set()  # request ids that had a disk load since admission
        self._loader: ThreadPoolExecutor | None = None
        # counters: tokens taken from each tier, pages evicted to them, disk loads
        self.host_hit_tokens = self.disk_hit_tokens = self.evicted_pages = self.loads = 0
        self.load_seconds = 0.0
        self.loaded_bytes = 0
        self.feature_loads = 0  # images whose features came from disk, not the tower

    @property
    def disk_on(self) -> bool:
        """Whether the disk tier can be read."""
        return self._open_disk() is not None

    def _open_disk(self) -> DiskTier | None:
        """The disk tier if it can be read (it turns itself off on an I/O error), else None."""
        disk = self.disk
        return disk if disk is not None and disk.enabled else None

    def _pending(self, key: bytes) -> torch.Tensor | None:
        return self.disk.pending(key) if self.disk is not None else None

    # ---- eviction (write-back) ----------------------------------------------
    def on_evict(self, keys: list[bytes], pages: list[int]) -> None:
        """Copy evicted pool ``pages`` (chain ``keys``) to the host tier and queue them for
        disk. Runs before the tree frees the pages."""
        if not pages:
            return
        todo = [
            (k, p)
            for k, p in zip(keys, pages, strict=True)
            if (self.host.max_bytes and k not in self.host)
            or (
                (disk := self._open_disk()) is not None
                and k not in disk
                and self._pending(k) is None
            )
        ]
        if not todo:
            return
        self.evicted_pages += len(todo)
        host = self._to_host([p for _, p in todo])
        for i, (key, _) in enumerate(todo):
            page = host[i]
            if self.host.max_bytes:
                self.host.put(key, page)
            disk = self._open_disk()
            if disk is not None:
                disk.write(key, page)

    def _to_host(self, pages: list[int]) -> torch.Tensor:
        kv = self.pool.read_pages(pages)  # [n, 2, L, P, Hkv, D] on the pool's device
        if kv.device.type == "cpu":
            return kv
        host = host_buffer(kv.shape, kv.dtype, self.pin)
        host.copy_(kv)
        return host

    def stack_pages(self, pages: list[torch.Tensor]) -> torch.Tensor:
        """``pages`` (from :meth:`take`, each ``[2, L, P, Hkv, D]``) stacked into one new
        host buffer ``[n, 2, L, P, Hkv, D]``, page-locked when the pool is on CUDA (so its
        copy to the device is one asynchronous transfer); pages are never pinned one by
        one.

        Raises:
            ValueError: no pages.
        """
        if not pages:
            raise ValueError("no pages to stack")
        out = host_buffer((len(pages), *pages[0].shape), pages[0].dtype, self.pin)
        torch.stack(pages, out=out)
        return out

    # ---- lookup and loading ---------------------------------------------------
    def lookup(self, parent: bytes, tokens: Sequence[int]) -> TierMatch:
        """Pages of ``tokens`` (following the page keyed ``parent``) held by the tiers.

        Walks page by page and stops at the first page no tier has (a chain key needs every
        page before it), so the cost is the hit pages plus one hash.

        Args:
            parent: chain key of the last device-cached page (``chain.root`` for none).
            tokens: the token ids after the device match (partial last page ignored).
        """
        out = TierMatch()
        P = self.page_size
        h = parent
        digest = xxhash.xxh3_128_digest
        raw = np.asarray(tokens[: len(tokens) - len(tokens) % P], dtype=np.int64).tobytes()
        step = 8 * P
        on_disk = False
        for i in range(0, len(raw), step):
            h = digest(h + raw[i : i + step])
            in_memory = h in self._staged or h in self.host or self._pending(h) is not None
            if not on_disk and in_memory:
                out.host_pages += 1
            elif (disk := self._open_disk()) is not None and (in_memory or h in disk):
                on_disk = True
                out.disk_pages += 1
            else:
                break
            out.keys.append(h)
        return out

    def take(self, keys: list[bytes]) -> list[torch.Tensor]:
        """Page tensors of the leading ``keys`` held in staging or host memory (stops at the
        first one missing); staged pages are removed, host pages stay."""
        out: list[torch.Tensor] = []
        for key in keys:
            page = self._staged.pop(key)
            if page is None:
                page = self._pending(key)
            if page is not None:
                self.disk_hit_tokens += self.page_size
            else:
                page = self.host.get(key)
                if page is None:
                    break
                self.host_hit_tokens += self.page_size
            out.append(page)
        return out

    def is_loading(self, rid: str) -> bool:
        """Whether request ``rid`` waits for a disk load."""
        return rid in self._jobs

    # ---- features (the feature tier) ------------------------------------------------
    @property
    def features_on(self) -> bool:
        """Whether image features are written to and read from disk."""
        return self._feature_io() is not None

    def _feature_io(self) -> tuple[DiskTier, FeatureCache] | None:
        """The disk tier and the feature cache if features go through them, else None."""
        disk = self._open_disk()
        if disk is None or self.feature_dim <= 0 or self.feature_cache is None:
            return None
        return disk, self.feature_cache

    def save_features(self, key: bytes, feats: torch.Tensor) -> None:
        """Queue image ``key``'s tower output ``[tokens, hidden]`` for disk (write-through:
        features are small next to the image's KV, and a restart needs them for the
        positions after the last whole page). Never blocks; skipped if already on disk."""
        io = self._feature_io()
        if io is not None and io[0].writable:
            io[0].write_features(key, feats.detach())

    def features_to_load(self, wanted: Iterable[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        """The images of ``wanted`` (``(image key, tokens)``) whose features are neither in
        the feature cache nor in the request but on disk. Features still in the write queue
        go to the cache at once (no read)."""
        io = self._feature_io()
        if io is None:
            return []
        disk, cache = io
        out: list[tuple[bytes, int]] = []
        for key, rows in wanted:
            if key in cache or any(k == key for k, _ in out):
                continue
            queued = disk.pending_features(key)
            if queued is not None and tuple(queued.shape) == (rows, self.feature_dim):
                cache.put(key, queued)
            elif disk.has_features(key):
                out.append((key, rows))
        return out

    def start_load(
        self, rid: str, keys: list[bytes], features: Sequence[tuple[bytes, int]] = ()
    ) -> bool:
        """Read the disk-only pages of ``keys`` and the image ``features``
        (``(image key, tokens)``, from :meth:`features_to_load`) for request ``rid`` on a
        loader thread; :meth:`poll` stages the pages and puts the features in the feature
        cache.

        Returns:
            False (nothing started) if the disk tier is off, ``rid`` had a load since its
            last :meth:`forget`, or every page is already in memory and no features are
            asked for.
        """
        if not self.disk_on or rid in self._tried or rid in self._jobs:
            return False
        todo = []
        for k in keys:
            if k in self._staged or k in self.host:
                continue
            page = self._pending(k)
            if page is not None:  # stage it now: once written it leaves the write queue
                self._staged.put(k, page)
            else:
                todo.append(k)
        self._tried.add(rid)
        features = list(features) if self.features_on else []
        if not todo and not features:
            return False
        if self._loader is None:
            self._loader = ThreadPoolExecutor(LOADER_THREADS, thread_name_prefix="kv-disk-loader")
        self._jobs.add(rid)
        self._loader.submit(self._load, rid, todo, features)
        return True

    def _load(self, rid: str, keys: list[bytes], features: list[tuple[bytes, int]]) -> None:
        t0 = time.perf_counter()
        pages: list[tuple[bytes, torch.Tensor]] = []
        feats: list[tuple[bytes, torch.Tensor]] = []
        disk = self.disk
        assert disk is not None  # start_load submits loads only while the disk tier is on
        try:
            for key in keys:
                page = disk.read(key)
                if page is None:
                    break  # the chain is cut here: later pages cannot be used
                pages.append((key, page))  # pinned once stacked (stack_pages), not here
            for key, rows in features:
                f = disk.read_features(key, rows, self.feature_dim)
                if f is not None:  # else the tower encodes the image: a miss, not an error
                    feats.append((key, f.to(self.pool.k_buffers[0].device)))
        except Exception:  # a failed load is a miss, never a stuck request
            log.exception("KV disk tier: load failed")
            pages, feats = [], []
        with self._done_lock:
            self._done.append((rid, pages, feats, time.perf_counter() - t0))
        self._done_event.set()

    def poll(self) -> int:
        """Move finished disk loads into staging (engine thread); returns loads finished."""
        if not self._jobs:
            return 0
        with self._done_lock:
            done, self._done = self._done, []
            self._done_event.clear()
        for rid, pages, feats, seconds in done:
            self._jobs.discard(rid)
            self.loads += 1
            self.load_seconds += seconds
            self.loaded_bytes += len(pages) * self.page_bytes
            for key, page in pages:
                self._staged.put(key, page)
            for key, f in feats:  # the runner finds them there instead of running the tower
                # features are read only when start_load was given some, i.e. features_on
                assert self.feature_cache is not None
                self.feature_cache.put(key, f)
                self.feature_loads += 1
                self.loaded_bytes += f.numel() * f.element_size()
        return len(done)

    def wait(self, timeout: float) -> None:
        """Sleep until a disk load finishes or ``timeout`` seconds pass (engine idle only)."""
        if self._jobs:
            self._done_event.wait(timeout)

    def pending(self) -> int:
        """Requests whose disk load is in flight."""
        return len(self._jobs)

    def forget(self, rid: str) -> None:
        """``rid`` was admitted or left: a later admission may load from disk again."""
        self._tried.discard(rid)

    # ---- shutdown and maintenance -------------------------------------------
    def flush_tree(
        self, nodes: Iterator[tuple[list[bytes], list[int]]], timeout: float = 60.0
    ) -> int:
        """Write every page of ``nodes`` (``(keys, pages)`` per tree node) and of the host
        tier to disk, then wait for the writer (seconds: at most ``timeout``).

        Returns:
            Pages queued for writing.
        """
        disk = self._open_disk()
        if disk is None or not disk.writable:
            return 0
        n = 0
        for key in self.host.keys():
            page = self.host.get(key, touch=False, count=False)
            if page is not None and disk.write(key, page, block=True):
                n += 1
        for keys, pages in nodes:
            todo = [(k, p) for k, p in zip(keys, pages, strict=True) if k not in disk]
            for i in range(0, len(todo), 64):  # bounded host copies at a time
                part = todo[i : i + 64]
                host = self._to_host([p for _, p in part])
                for j, (key, _) in enumerate(part):
                    n += disk.write(key, host[j], block=True)
        disk.flush(timeout)
        return n

    def write_through(self, keys: list[bytes], pages: list[int]) -> int:
        """Queue ``pages`` (pool page ids, content ``keys``) for the disk tier now, not at
        eviction (``prompt_cache_retention: "24h"``); pages already on disk are skipped,
        nothing waits for the writer.

        Returns:
            Pages queued (0 without a writable disk tier).
        """
        disk = self._open_disk()
        if disk is None or not disk.writable:
            return 0
        todo = [(k, p) for k, p in zip(keys, pages, strict=True) if k not in disk]
        n = 0
        for i in range(0, len(todo), 64):  # bounded host copies at a time
            part = todo[i : i + 64]
            host = self._to_host([p for _, p in part])
            for j, (key, _) in enumerate(part):
                n += disk.write(key, host[j])
        return n

    def clear_memory(self) -> None:
        """Drop the host tier and staged pages (the disk, shared with others, stays)."""
        self.host.clear()
        self._staged.clear()

    def close(self, timeout: float = 60.0) -> None:
        """Stop the loader and writer threads after queued writes finish."""
        if self._loader is not None:
            self._loader.shutdown(wait=True, cancel_futures=True)
            self._loader = None
        if self.disk is not None:
            self.disk.close(timeout)

    def stats(self) -> dict[str, float]:
        """Per-tier figures for ``/v1/cache/stats`` and ``/metrics``."""
        disk = self.disk
        return {
            "tier_host_hit_tokens": self.host_hit_tokens,
            "tier_disk_hit_tokens": self.disk_hit_tokens,
            "tier_host_pages": len(self.host),
            "tier_host_bytes": self.host.nbytes,
            "tier_host_capacity_bytes": self.host.max_bytes or 0,  # host_tier always sets it
            "tier_disk_pages": len(disk) if disk is not None else 0,
            "tier_disk_bytes": disk.bytes_used if disk is not None else 0,
            "tier_disk_capacity_bytes": disk.capacity_bytes if disk is not None else 0,
            "tier_disk_on": int(self.disk_on),
            "tier_disk_writable": int(disk is not None and disk.writable),
            "tier_disk_writes": disk.writes if disk is not None else 0,
            "tier_disk_writes_dropped": disk.writes_dropped if disk is not None else 0,
            "tier_disk_read_failures": disk.read_failures if disk is not None else 0,
            "tier_disk_feature_files": disk.feature_files if disk is not None else 0,
            "tier_disk_feature_writes": disk.feature_writes if disk is not None else 0,
            "tier_feature_loads": self.feature_loads,
            "tier_evicted_pages": self.evicted_pages,
            "tier_loads": self.loads,
            "tier_load_seconds": self.load_seconds,
            "tier_loaded_bytes": self.loaded_bytes,
            "tier_loading_requests": len(self._jobs),
        }
