"""Host-memory and disk KV tiers behind the radix tree, keyed by content.

The radix tree (:mod:`mmserve.cache.radix_cache`) holds KV pages only while they
are in the device pool. The tiers keep pages the tree evicts, so a prefix the
pool lost (or a process that never computed it) can load its KV instead of
recomputing it, the way SGLang's HiCache (device -> host -> storage) does.

**Page keys.** A page's key is a hash chain (xxHash XXH3-128): the key of page
``i`` is ``XXH3_128(key(i-1) || int64 bytes of its P token ids)``, and the chain
starts from a root key that hashes the *namespace*: the model fingerprint
(:func:`model_fingerprint`: config plus sampled weights), the KV dtype, the page
size and the KV layout (with an fp8 pool's per-layer scales). A key therefore names
the KV of a whole prefix on one checkpoint; image pseudo-token ids are content hashes,
so images are included. Two checkpoints, KV dtypes (bf16 and fp8 pages never mix) or
page sizes never share a key, and the disk tier also puts each namespace in its own
directory and writes it in every file header.

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

**Disk format.** One file per page, ``DIR/<namespace hex>/<key hex>.kv``: a
64-byte header (magic, format version, namespace, key, payload length, XXH3-64
checksum of the payload) followed by the raw page ``[2, L, P, Hkv, D]`` bytes (one
byte per element for an fp8 pool).
Features: ``<image key hex>.feat``, an 80-byte header (another magic, the same
fields, then rows, columns and dtype) and the raw ``[tokens, hidden]`` bytes; a read
also checks the shape against the prompt's run of the image. Pages and features share
one least-recently-used order and the ``disk_bytes`` bound.
Files are written to a unique temporary name in the same directory, then
renamed over the final name (atomic on POSIX), so a reader sees a whole file or
none, and concurrent writers of one page leave one whole file. A file whose
header or checksum does not match is deleted and treated as a miss. The disk
tier keeps an in-memory index (key -> bytes, least recently used first),
rebuilt from the directory at start and rescanned every few seconds, so files
written by another process sharing the directory are found without touching
the file system on the engine thread. Past ``disk_bytes`` the least recently
used files are deleted. An unwritable directory or a full disk turns writing
off with one warning; serving goes on.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from mmserve.cache.kv_pool import KVPool
from mmserve.lru import LRU

log = logging.getLogger(__name__)

#: Bumped whenever the file layout or the key derivation changes.
FORMAT_VERSION = 1
# The header fields every file starts with: magic, format version, reserved, namespace (16),
# key (16), payload bytes, payload XXH3-64. Each kind of file appends fields of its own.
_COMMON = struct.Struct("<8sHH16s16sQQ")


@dataclass(frozen=True)
class _FileKind:
    """One kind of checked file: its magic, its name suffix, the header fields it adds after
    the common ones, and the prefix of its keys in the disk tier's index."""

    magic: bytes
    suffix: str
    extra: struct.Struct
    prefix: bytes

    @property
    def header_bytes(self) -> int:
        return _COMMON.size + self.extra.size


_PAGES = _FileKind(b"MMKVPAGE", ".kv", struct.Struct("<4x"), b"")  # 64-byte header
# rows, cols, dtype code; 80-byte header. Page keys are 16 bytes, so the prefix separates them.
_FEATURES = _FileKind(b"MMKVFEAT", ".feat", struct.Struct("<IIB11x"), b"feat")
HEADER_BYTES = _PAGES.header_bytes  # 64
_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
#: Threads reading pages from disk: one slow read does not hold up other requests' loads.
LOADER_THREADS = 4
#: Seconds between rescans of the disk directory (pages other processes wrote).
RESCAN_SECONDS = 2.0
#: Temporary files older than this (seconds) are left-overs of a crashed writer.
_STALE_TMP_SECONDS = 3600.0


def model_fingerprint(config_text: str, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """Identity of a checkpoint: 16 bytes of XXH3-128 over its config and sampled weights.

    Hashing every weight would read gigabytes at start; instead each tensor contributes its
    name, shape, dtype and up to 1,024 evenly strided elements, which separates any two
    checkpoints that differ in config, architecture or training.

    Args:
        config_text: the model config serialized as text (e.g. ``config.to_json_string()``).
        named_tensors: ``(name, tensor)`` pairs (any device, any dtype).

    Returns:
        16-byte digest.
    """
    h = xxhash.xxh3_128()
    h.update(config_text.encode())
    for name, t in named_tensors:
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 1024)][:1024]
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(sample.float().cpu().numpy().tobytes())
    return h.digest()


def kv_namespace(fingerprint: bytes, dtype: torch.dtype, page_size: int, layout: Sequence) -> bytes:
    """Namespace of KV pages: model fingerprint, KV dtype, page size and layout (16 bytes).

    Args:
        fingerprint: :func:`model_fingerprint` of the checkpoint.
        dtype: KV pool dtype.
        page_size: tokens per page ``P``.
        layout: anything else that changes a page's bytes, e.g.
            ``("NHD", num_layers, num_kv_heads, head_dim)``.
    """
    text = f"v{FORMAT_VERSION}|{dtype}|P={page_size}|{tuple(layout)}".encode()
    return xxhash.xxh3_128_digest(fingerprint + text)


class PageKeyChain:
    """Content keys of pages: ``key(i) = XXH3_128(key(i-1) || int64 token ids of page i)``.

    Args:
        namespace: :func:`kv_namespace` bytes; the chain's root key hashes it, so keys of
            different checkpoints, dtypes or page sizes never collide.
        page_size: tokens per page ``P``.
    """

    def __init__(self, namespace: bytes, page_size: int) -> None:
        self.page_size = page_size
        self.root = xxhash.xxh3_128_digest(b"root|" + namespace)

    def chain(self, parent: bytes, tokens: Sequence[int]) -> list[bytes]:
        """Keys of the full pages of ``tokens`` following the page keyed ``parent``.

        Args:
            parent: key of the page before ``tokens`` (:attr:`root` at the start).
            tokens: token ids (text ids >= 0, image pseudo-ids negative int64); a trailing
                partial page is ignored.

        Returns:
            ``len(tokens) // P`` keys of 16 bytes each.
        """
        P = self.page_size
        n = len(tokens) // P
        if n == 0:
            return []
        raw = np.asarray(tokens[: n * P], dtype=np.int64).tobytes()
        step = 8 * P
        out = []
        h = parent
        digest = xxhash.xxh3_128_digest
        for i in range(0, n * step, step):
            h = digest(h + raw[i : i + step])
            out.append(h)
        return out


def host_tier(capacity_bytes: int, page_bytes: int) -> LRU[bytes, torch.Tensor]:
    """The host tier: page tensors in host memory (pinned when the pool is on CUDA) in an
    :class:`~mmserve.lru.LRU` bounded at ``capacity_bytes``, every page counted as
    ``page_bytes`` (all pages have the same shape). A capacity below one page holds nothing.
    """
    return LRU(max_bytes=capacity_bytes, size=lambda _page: page_bytes)


class DiskTier:
    """Files under ``root/<namespace hex>/``: one per KV page, one per image's projected
    features; one LRU over both, bounded in bytes.

    Thread safety: the index is guarded by a lock; :meth:`write` and
    :meth:`write_features` queue work for the writer thread and never block (unless
    ``block``); :meth:`read` and :meth:`read_features` run on the caller's thread (the
    loader threads in :class:`KVTiers`).

    Args:
        root: directory shared by every process and checkpoint (created if missing).
        namespace: :func:`kv_namespace` bytes; files of other namespaces are never read.
        capacity_bytes: most bytes of files (headers included) kept, pages and features
            together; least recently used files are deleted beyond it (a file larger than
            the whole capacity is deleted at once).
        page_shape: shape of one page tensor ``[2, L, P, Hkv, D]``.
        dtype: page dtype.
        rescan_seconds: how often the writer thread rescans the directory when idle.
        max_queued_bytes: bytes of writes waiting for the writer before new ones are
            dropped (counted in ``writes_dropped``).

    Attributes:
        enabled: False when the directory could not be created or written at start.
        writable: turned False (with one warning) by a write error such as a full disk.
    """

    def __init__(
        self,
        root: str,
        namespace: bytes,
        capacity_bytes: int,
        page_shape: Sequence[int],
        dtype: torch.dtype,
        rescan_seconds: float = RESCAN_SECONDS,
        max_queued_bytes: int = 256 << 20,
    ) -> None:
        self.namespace = namespace
        self.dir = os.path.join(root, namespace.hex())
        self.capacity_bytes = capacity_bytes
        self.page_shape = tuple(page_shape)
        self.dtype = dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.payload_bytes = int(np.prod(self.page_shape)) * itemsize
        self.file_bytes = HEADER_BYTES + self.payload_bytes
        self.rescan_seconds = rescan_seconds
        self.max_queued_bytes = max_queued_bytes
        # guards the index with its feature count, and the write queue's bookkeeping
        self._lock = threading.Lock()
        # index key (a page key, or the feature prefix + image key) -> file bytes
        self._index: LRU[bytes, int] = LRU(max_bytes=capacity_bytes, size=lambda n: n)
        self._feature_files = 0
        # writes queued for the writer: still in memory, so they count as hits
        self._pending: dict[bytes, torch.Tensor] = {}
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._tmp_counter = 0
        self.enabled = self.writable = True
        # counters: files written, writes dropped, files read, bad files, files deleted
        self.writes = self.feature_writes = self.writes_dropped = 0
        self.reads = self.feature_reads = self.read_failures = self.deleted = 0
        try:
            os.makedirs(self.dir, exist_ok=True)
            probe = os.path.join(self.dir, f".probe.{os.getpid()}.{threading.get_ident()}.tmp")
            with open(probe, "wb") as f:
                f.write(b"x")
            os.unlink(probe)
        except OSError as e:
            log.warning("KV disk tier off: cannot write %s (%s)", self.dir, e)
            self.enabled = self.writable = False
            return
        self.rescan()
        self._stop = False
        self._thread = threading.Thread(target=self._writer, name="kv-disk-writer", daemon=True)
        self._thread.start()

    # ---- index ------------------------------------------------------------
    @staticmethod
    def _kind(ikey: bytes) -> _FileKind:
        return _PAGES if len(ikey) == 16 else _FEATURES

    def _path(self, ikey: bytes) -> str:
        kind = self._kind(ikey)
        return os.path.join(self.dir, ikey[len(kind.prefix) :].hex() + kind.suffix)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def has_features(self, key: bytes) -> bool:
        """Whether features of image ``key`` are on disk (per the index)."""
        return _FEATURES.prefix + key in self._index

    def __len__(self) -> int:
        """Pages on disk (per the index)."""
        with self._lock:
            return len(self._index) - self._feature_files

    @property
    def feature_files(self) -> int:
        """Feature files on disk (per the index)."""
        return self._feature_files

    @property
    def bytes_used(self) -> int:
        """Bytes of the indexed files (pages and features)."""
        return self._index.nbytes

    def _add(self, ikey: bytes, size: int) -> list[bytes]:
        """Index ``ikey`` (a file of ``size`` bytes) as the most recently used file (lock
        held); returns the index keys whose files must go: the least recently used ones past
        the capacity, or ``ikey`` itself when it alone exceeds it."""
        if size > self.capacity_bytes:
            self._remove(ikey)
            return [ikey]
        self._feature_files += ikey not in self._index and self._kind(ikey) is _FEATURES
        evicted = [k for k, _ in self._index.put(ikey, size)]
        self._feature_files -= sum(self._kind(k) is _FEATURES for k in evicted)
        return evicted

    def _remove(self, ikey: bytes) -> bool:
        """Drop ``ikey`` from the index (lock held); whether it was there."""
        if self._index.pop(ikey) is None:
            return False
        self._feature_files -= self._kind(ikey) is _FEATURES
        return True

    def rescan(self) -> None:
        """Sync the index with the directory: add files other processes wrote (ordered by
        modification time), drop files that are gone, delete stale temporary files."""
        if not self.enabled:
            return
        kinds = {kind.suffix: kind for kind in (_PAGES, _FEATURES)}
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        try:
            with os.scandir(self.dir) as it:
                for entry in it:
                    name = entry.name
                    if name.startswith("."):
                        if name.endswith(".tmp"):
                            try:
                                if now - entry.stat().st_mtime > _STALE_TMP_SECONDS:
                                    os.unlink(entry.path)
                            except OSError:
                                pass
                        continue
                    stem, ext = os.path.splitext(name)
                    kind = kinds.get(ext)
                    if len(stem) != 32 or kind is None:
                        continue
                    try:
                        key = bytes.fromhex(stem)
                        st = entry.stat()
                    except (ValueError, OSError):
                        continue
                    size = self.file_bytes if kind is _PAGES else st.st_size
                    found.append((st.st_mtime, kind.prefix + key, size))
        except OSError as e:
            log.warning("KV disk tier: cannot list %s (%s)", self.dir, e)
            return
        found.sort()
        present = {k for _, k, _ in found}
        victims = []
        with self._lock:
            for ikey in [k for k in self._index.keys() if k not in present]:
                self._remove(ikey)
            for _, ikey, size in found:
                if ikey not in self._index:
                    victims += self._add(ikey, size)
        self._unlink(victims)

    def _unlink(self, ikeys: Iterable[bytes]) -> None:
        for ikey in ikeys:
            try:
                os.unlink(self._path(ikey))
                self.deleted += 1
            except OSError:
                pass

    def _drop(self, ikey: bytes, delete: bool) -> None:
        with self._lock:
            self._remove(ikey)
        if delete:
            self._unlink([ikey])

    # ---- writing ----------------------------------------------------------
    def write(self, key: bytes, page: torch.Tensor, block: bool = False) -> bool:
        """Queue ``page`` (``[2, L, P, Hkv, D]``, CPU, never modified afterwards) for disk.

        Args:
            key: the page's chain key.
            page: page tensor.
            block: wait for room in the queue instead of dropping the write (shutdown).

        Returns:
            False if not queued (tier off, key already on disk, or queue full).
        """
        return self._enqueue(key, page, self.payload_bytes, block)

    def write_features(self, key: bytes, feats: torch.Tensor, block: bool = False) -> bool:
        """Queue an image's projected features ``[tokens, hidden]`` (float32, float16 or
        bfloat16, any device, never modified afterwards) for disk.

        Args:
            key: the image's 16-byte key (:func:`mmserve.vision.hashing.image_key`).
            feats: the features.
            block: wait for room in the queue instead of dropping the write.

        Returns:
            False if not queued (tier off, already on disk, queue full, or a dtype or
            shape the format does not hold).
        """
        if feats.dim() != 2 or feats.dtype not in _DTYPE_CODES:
            return False
        nbytes = feats.numel() * feats.element_size()
        return self._enqueue(_FEATURES.prefix + key, feats, nbytes, block)

    def _enqueue(self, ikey: bytes, tensor: torch.Tensor, nbytes: int, block: bool) -> bool:
        if not self.writable or ikey in self:
            return False
        if nbytes > self.max_queued_bytes:
            self.writes_dropped += 1
            return False
        if self._queued_bytes + nbytes > self.max_queued_bytes:
            if not block:
                self.writes_dropped += 1
                return False
            while self._queued_bytes + nbytes > self.max_queued_bytes and self.writable:
                time.sleep(0.005)
        with self._lock:
            if ikey in self._pending:
                return False
            self._queued_bytes += nbytes
            self._pending[ikey] = tensor
        self._queue.put((ikey, tensor, nbytes))
        return True

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued write is done (seconds: at most ``timeout``).

        Returns:
            True if the queue drained in time.
        """
        if not self.enabled:
            return True
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Finish queued writes, then stop the writer thread."""
        if not self.enabled:
            return
        self.flush(timeout)
        self._stop = True
        self._queue.put(None)
        self._thread.join(timeout)

    def _writer(self) -> None:
        last_scan = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=self.rescan_seconds)
            except queue.Empty:
                item = False
            if item is None or self._stop:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            if item is not False:
                ikey, tensor, nbytes = item
                try:
                    if self.writable and ikey not in self:
                        if self._kind(ikey) is _PAGES:
                            self.write_now(ikey, tensor)
                        else:
                            self.write_features_now(ikey[len(_FEATURES.prefix) :], tensor)
                except Exception:  # noqa: BLE001 - the writer thread must outlive one bad write
                    log.exception("KV disk tier: write failed")
                with self._lock:
                    self._queued_bytes -= nbytes
                    self._pending.pop(ikey, None)
            if time.monotonic() - last_scan >= self.rescan_seconds and self._queue.empty():
                self.rescan()
                last_scan = time.monotonic()

    def write_now(self, key: bytes, page: torch.Tensor) -> bool:
        """Write ``page`` to its file on this thread (temporary file, then rename).

        Returns:
            True if written; an ``OSError`` (full disk, permissions) turns writing off with
            one warning and returns False.

        Raises:
            ValueError: a page of another size than ``page_shape`` and ``dtype`` give.
        """
        payload = page.detach().contiguous().cpu().view(torch.uint8).numpy()
        if payload.nbytes != self.payload_bytes:
            raise ValueError(f"page of {payload.nbytes} bytes, expected {self.payload_bytes}")
        if not self._write_checked(_PAGES, key, payload):
            return False
        self.writes += 1
        return True

    def write_features_now(self, key: bytes, feats: torch.Tensor) -> bool:
        """Write image ``key``'s features ``[tokens, hidden]`` to its file on this thread
        (temporary file, then rename).

        Returns:
            True if written; False after an ``OSError`` (writing turned off, one warning).

        Raises:
            ValueError: a tensor that is not 2-D float32, float16 or bfloat16.
        """
        code = _DTYPE_CODES.get(feats.dtype)
        if feats.dim() != 2 or code is None:
            raise ValueError(f"features of shape {tuple(feats.shape)} and dtype {feats.dtype}")
        payload = feats.detach().contiguous().cpu().view(torch.uint8).numpy().reshape(-1)
        if not self._write_checked(_FEATURES, key, payload, *feats.shape, code):
            return False
        self.feature_writes += 1
        return True

    def _write_checked(self, kind: _FileKind, key: bytes, payload: np.ndarray, *extra) -> bool:  # noqa: ANN002
        """Write the file of ``key``: the common header (checksum of ``payload``), the
        ``extra`` fields of ``kind``, then ``payload``, to a unique temporary file renamed
        over the final name (a reader sees a whole file or none; concurrent writers of one
        key leave one whole file); then index it, deleting files past the capacity.

        Returns:
            True if written; False after an ``OSError`` (writing turned off, one warning).
        """
        ikey = kind.prefix + key
        header = _COMMON.pack(
            kind.magic,
            FORMAT_VERSION,
            0,
            self.namespace,
            key,
            payload.nbytes,
            xxhash.xxh3_64_intdigest(payload),
        ) + kind.extra.pack(*extra)
        path = self._path(ikey)
        self._tmp_counter += 1
        tmp = os.path.join(
            self.dir,
            f".{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}"
            f".{self._tmp_counter}.tmp",
        )
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload.data)
            os.replace(tmp, path)
        except OSError as e:
            if self.writable:
                log.warning("KV disk tier: writing off after %s (%s)", path, e)
            self.writable = False
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        with self._lock:
            victims = self._add(ikey, len(header) + payload.nbytes)
        self._unlink(victims)
        return True

    # ---- reading ----------------------------------------------------------
    def pending(self, key: bytes) -> torch.Tensor | None:
        """The page for ``key`` if it waits in the write queue (in memory), else None."""
        with self._lock:
            return self._pending.get(key)

    def pending_features(self, key: bytes) -> torch.Tensor | None:
        """Image ``key``'s features if they wait in the write queue, else None."""
        with self._lock:
            return self._pending.get(_FEATURES.prefix + key)

    def _read_checked(
        self,
        kind: _FileKind,
        key: bytes,
        max_payload: int,
        accept: Callable[[tuple, int], bool],
    ) -> tuple[tuple, bytearray] | None:
        """Read the file of ``key`` and check it: magic, format version, namespace, key,
        payload length and checksum, then ``accept(extra header fields, payload bytes)``.
        At most ``max_payload`` payload bytes are read.

        Returns:
            The extra header fields and the payload, or None for a miss: a missing file
            leaves the index; a bad one (truncated, corrupted, foreign, not accepted) is
            deleted and counted in ``read_failures``. A hit becomes most recently used.
        """
        if not self.enabled:
            return None
        ikey = kind.prefix + key
        head = kind.header_bytes
        try:
            with open(self._path(ikey), "rb") as f:
                data = f.read(head + max_payload + 1)
        except OSError:
            self._drop(ikey, delete=False)
            return None
        ok = head <= len(data) <= head + max_payload
        if ok:
            magic, version, _, ns, fkey, n, check = _COMMON.unpack_from(data)
            extra = kind.extra.unpack_from(data, _COMMON.size)
            payload = memoryview(data)[head:]
            ok = (
                magic == kind.magic
                and version == FORMAT_VERSION
                and ns == self.namespace
                and fkey == key
                and n == len(payload)
                and accept(extra, n)
                and xxhash.xxh3_64_intdigest(payload) == check
            )
        if not ok:
            self.read_failures += 1
            log.warning("KV disk tier: ignoring and deleting bad file %s", self._path(ikey))
            self._drop(ikey, delete=True)
            return None
        self._index.touch(ikey)
        return extra, bytearray(payload)

    def read(self, key: bytes) -> torch.Tensor | None:
        """Read and check the page for ``key`` on the caller's thread.

        Returns:
            The page tensor ``[2, L, P, Hkv, D]`` (CPU), or None for a miss. A file that is
            missing, truncated, corrupted (checksum), or of another namespace, key, version
            or size is a miss; a bad file is deleted.
        """
        got = self._read_checked(
            _PAGES, key, self.payload_bytes, lambda _extra, n: n == self.payload_bytes
        )
        if got is None:
            return None
        self.reads += 1
        buf = got[1]
        return torch.frombuffer(buf, dtype=torch.uint8).view(self.dtype).reshape(self.page_shape)

    def read_features(self, key: bytes, rows: int, cols: int) -> torch.Tensor | None:
        """Read and check image ``key``'s features on the caller's thread.

        Args:
            key: the image key.
            rows: tokens the image takes in the prompt (the file must hold that many).
            cols: the decoder's hidden size.

        Returns:
            ``[rows, cols]`` CPU tensor in the dtype written, or None for a miss. A file that
            is missing, truncated, corrupted, or of another namespace, key, version or shape
            is a miss; a bad file is deleted. At most ``rows * cols * 4`` payload bytes are
            read.
        """

        def accept(extra: tuple, n: int) -> bool:
            r, c, code = extra
            dtype = _CODE_DTYPES.get(code)
            return (
                (r, c) == (rows, cols)
                and dtype is not None
                and n == rows * cols * torch.empty((), dtype=dtype).element_size()
            )

        got = self._read_checked(_FEATURES, key, rows * cols * 4, accept)
        if got is None:
            return None
        self.feature_reads += 1
        (_, _, code), buf = got
        return torch.frombuffer(buf, dtype=torch.uint8).view(_CODE_DTYPES[code]).reshape(rows, cols)


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
        feature_cache: object | None = None,
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
        return self.disk is not None and self.disk.enabled

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
            or (self.disk_on and k not in self.disk and self._pending(k) is None)
        ]
        if not todo:
            return
        self.evicted_pages += len(todo)
        host = self._to_host([p for _, p in todo])
        for i, (key, _) in enumerate(todo):
            page = host[i]
            if self.host.max_bytes:
                self.host.put(key, page)
            if self.disk_on:
                self.disk.write(key, page)

    def _to_host(self, pages: list[int]) -> torch.Tensor:
        kv = self.pool.read_pages(pages)  # [n, 2, L, P, Hkv, D] on the pool's device
        if kv.device.type == "cpu":
            return kv
        host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=self.pin)
        host.copy_(kv)
        return host

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
            elif self.disk_on and (in_memory or h in self.disk):
                on_disk = True
                out.disk_pages += 1
            else:
                break
            out.keys.append(h)
        return out

    def take(self, keys: list[bytes]) -> list[torch.Tensor]:
        """Page tensors of the leading ``keys`` held in staging or host memory (stops at the
        first one missing); staged pages are removed, host pages stay."""
        out = []
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
        return self.disk_on and self.feature_dim > 0 and self.feature_cache is not None

    def save_features(self, key: bytes, feats: torch.Tensor) -> None:
        """Queue image ``key``'s tower output ``[tokens, hidden]`` for disk (write-through:
        features are small next to the image's KV, and a restart needs them for the
        positions after the last whole page). Never blocks; skipped if already on disk."""
        if self.features_on and self.disk.writable:
            self.disk.write_features(key, feats.detach())

    def features_to_load(self, wanted: Iterable[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        """The images of ``wanted`` (``(image key, tokens)``) whose features are neither in
        the feature cache nor in the request but on disk. Features still in the write queue
        go to the cache at once (no read)."""
        if not self.features_on:
            return []
        out = []
        for key, rows in wanted:
            if key in self.feature_cache or any(k == key for k, _ in out):
                continue
            queued = self.disk.pending_features(key)
            if queued is not None and tuple(queued.shape) == (rows, self.feature_dim):
                self.feature_cache.put(key, queued)
            elif self.disk.has_features(key):
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
        try:
            for key in keys:
                page = self.disk.read(key)
                if page is None:
                    break  # the chain is cut here: later pages cannot be used
                if self.pin:
                    page = page.pin_memory()
                pages.append((key, page))
            for key, rows in features:
                f = self.disk.read_features(key, rows, self.feature_dim)
                if f is not None:  # else the tower encodes the image: a miss, not an error
                    feats.append((key, f.to(self.pool.k_buffers[0].device)))
        except Exception:  # noqa: BLE001 - a failed load is a miss, never a stuck request
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
        if not self.disk_on or not self.disk.writable:
            return 0
        n = 0
        for key in self.host.keys():
            page = self.host.get(key, touch=False, count=False)
            if page is not None and self.disk.write(key, page, block=True):
                n += 1
        for keys, pages in nodes:
            todo = [(k, p) for k, p in zip(keys, pages, strict=True) if k not in self.disk]
            for i in range(0, len(todo), 64):  # bounded host copies at a time
                part = todo[i : i + 64]
                host = self._to_host([p for _, p in part])
                for j, (key, _) in enumerate(part):
                    n += self.disk.write(key, host[j], block=True)
        self.disk.flush(timeout)
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
            "tier_host_capacity_bytes": self.host.max_bytes,
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
