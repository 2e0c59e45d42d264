"""The disk tier: one checked file per KV page and per image's features, behind an LRU index.

One file per page, ``DIR/<namespace hex>/<key hex>.kv``: a
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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from mmserve.cache.kv_tiers.keys import FORMAT_VERSION
from mmserve.lru import LRU

log = logging.getLogger(__name__)

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
#: Seconds between rescans of the disk directory (pages other processes wrote).
RESCAN_SECONDS = 2.0
#: Temporary files older than this (seconds) are left-overs of a crashed writer.
_STALE_TMP_SECONDS = 3600.0


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
        if not self._thread.is_alive():  # closed: nothing will drain the queue
            return self._queue.empty()
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Finish queued writes, then stop the writer thread."""
        if not self.enabled or self._stop:
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
                except Exception:  # the writer thread must outlive one bad write
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

    def _write_checked(self, kind: _FileKind, key: bytes, payload: np.ndarray, *extra) -> bool:
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
            xxhash.xxh3_64_intdigest(payload.data),
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
