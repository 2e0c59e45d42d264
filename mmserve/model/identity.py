"""The identity of a served model: what every persistent or shared cache is keyed on.

A KV page, an image's features or a routed prefix computed by one checkpoint must never be
taken for another's, so the key of every cache that outlives a process or is shared between
processes (the disk KV tier, the host tier, the encoder deployment's features, the replica
router's trees) starts from :func:`model_identity`: a 16-byte XXH3-128 over

- every byte of every weight file the loader reads (:func:`checkpoint_digest`; a sample of
  the weights is not enough: a fine-tune that touches rows a strided sample skips, or one
  element, would share pages with its base), and every other file of the checkpoint
  directory (config, tokenizer, processor, chat template, generation config), byte for byte;
- for a model built in memory without files (tests), every byte of every tensor instead
  (:func:`~mmserve.cache.kv_tiers.keys.model_fingerprint`), with the config, tokenizer
  and processor settings;
- the compute dtype and the weight quantization.

The KV dtype, the fp8 KV scales, the page size and the layout are added by
:func:`~mmserve.cache.kv_tiers.keys.kv_namespace`.

Reading gigabytes at each start would be slow, so each file's digest is remembered in a
small JSON memo (:func:`memo_path`), by real path, size, mtime, ctime, inode and device: a
restart rereads nothing unless a file changed. Each process logs the identity once, with
the bytes it read and the seconds it took.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from mmserve.cache.kv_tiers.keys import model_fingerprint
from mmserve.model.llama import token_embedding
from mmserve.model.weights import weight_files

if TYPE_CHECKING:
    from mmserve.model.loader import LoadedModel

log = logging.getLogger(__name__)

#: Bumped when what the identity covers changes (old memo entries stay valid: they are
#: digests of single files).
IDENTITY_VERSION = 1
#: Bytes read per call while hashing a file.
CHUNK_BYTES = 16 << 20
#: Files the memo remembers (the oldest are dropped beyond it).
MEMO_ENTRIES = 4096
#: Suffixes of weight files: only those the loader reads (:func:`weight_files`) count;
#: other weight files in the directory (a ``.bin`` copy, ``consolidated.*``) are not read.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
#: Files that do not change what the model computes.
_SKIPPED_SUFFIXES = (".md", ".lock")

_memo_lock = threading.Lock()
#: :func:`checkpoint_identity` answers of this process, by directory, settings and stats.
_identities: dict[tuple, bytes] = {}


def memo_path() -> Path:
    """Where per-file digests are remembered: ``$MMSERVE_CACHE_DIR/checkpoint-digests.json``,
    else under ``$XDG_CACHE_HOME/mmserve``, else under ``~/.cache/mmserve``."""
    root = os.environ.get("MMSERVE_CACHE_DIR")
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = str(Path(cache) / "mmserve")
    return Path(root) / "checkpoint-digests.json"


@dataclass
class CheckpointDigest:
    """:func:`checkpoint_digest`'s answer.

    Attributes:
        digest: 16-byte XXH3-128 of the directory's files (names, sizes and contents).
        files: files hashed.
        bytes_total: their size in bytes.
        bytes_read: bytes read to hash them now (0 when every file came from the memo).
        memo_hits: files whose digest came from the memo.
        seconds: wall time spent.
    """

    digest: bytes
    files: int
    bytes_total: int
    bytes_read: int
    memo_hits: int
    seconds: float


def _stat_key(st: os.stat_result) -> list[int]:
    # ctime too: a rewrite that restores the size and mtime (utime) still moves it
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _load_memo(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        files = data["files"]
        return files if isinstance(files, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _save_memo(path: Path, updates: dict[str, Any]) -> None:
    """Merge ``updates`` into the memo file (re-read first: other processes write it too)
    and replace it atomically; a memo that cannot be written is only a slower restart."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        files = _load_memo(path)
        for k in updates:
            files.pop(k, None)  # re-inserted last: the newest are kept
        files.update(updates)
        while len(files) > MEMO_ENTRIES:
            files.pop(next(iter(files)))
        fd, tmp = tempfile.mkstemp(prefix=".digests.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": IDENTITY_VERSION, "files": files}, f)
            os.replace(tmp, path)
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.warning("cannot write the checkpoint digest memo %s: %s", path, exc)


def _remembered(entry: Any, stat: list[int]) -> bytes | None:
    """The digest a memo entry holds for a file with ``stat``, or None (another stat, or
    an entry damaged by hand)."""
    if not isinstance(entry, dict) or entry.get("stat") != stat:
        return None
    try:
        digest = bytes.fromhex(entry["digest"])
    except (KeyError, TypeError, ValueError):
        return None
    return digest if len(digest) == 16 else None


def _hash_file(path: Path) -> tuple[bytes, int]:
    """XXH3-128 of every byte of ``path`` and the bytes read."""
    h = xxhash.xxh3_128()
    n = 0
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while got := f.readinto(buf):
            h.update(view[:got])
            n += got
    return h.digest(), n


#: sub-folders of a checkpoint whose files the front end reads (transformers'
#: ``additional_chat_templates/``); no other folder's files are part of the identity
_FRONT_END_DIRS = frozenset({"additional_chat_templates"})


def checkpoint_files(model_dir: Path) -> list[tuple[str, Path]]:
    """The files that make up ``model_dir``'s model, as ``(path relative to model_dir,
    real path)`` sorted by the former: the weight files the loader reads
    (:func:`~mmserve.model.weights.weight_files`) and every other file at its top level
    (config, tokenizer, processor, chat template...) or in ``additional_chat_templates/``,
    except hidden ones, other weight files and ``*.md`` / ``*.lock``; other folders (a
    server's state kept beside the weights) are not part of the model. A link (a Hugging
    Face cache snapshot links every file to a blob) is named by its own path and read
    through its target.

    Raises:
        CheckpointError: as :func:`~mmserve.model.weights.weight_files`.
    """
    found = {p.relative_to(model_dir).as_posix(): p for p in weight_files(model_dir)}
    for root, dirs, names in os.walk(model_dir):
        # the front end's files are at the top (and transformers' extra chat templates one
        # folder down); other folders may be a server's state (a --kv-disk-dir or an image
        # store put beside the weights) and would change the identity on every start
        dirs[:] = [d for d in dirs if d in _FRONT_END_DIRS and Path(root) == Path(model_dir)]
        for name in names:
            if name.startswith(".") or name.endswith(WEIGHT_SUFFIXES + _SKIPPED_SUFFIXES):
                continue
            p = Path(root) / name
            if p.is_file():
                found[p.relative_to(model_dir).as_posix()] = p
    return [(rel, found[rel].resolve()) for rel in sorted(found)]


def checkpoint_digest(model_dir: str | Path, memo: Path | None = None) -> CheckpointDigest:
    """Digest of every byte of the files of ``model_dir`` (:func:`checkpoint_files`).

    Each file is hashed whole (XXH3-128, read in :data:`CHUNK_BYTES` chunks), then the
    directory's digest is XXH3-128 over each file's relative name, size and digest. A
    file's digest is remembered in ``memo`` (default :func:`memo_path`) under its real
    path, with its size, mtime, ctime, inode and device; a later call (another process,
    a restart) takes it from there unless one of them changed, reading nothing.

    Args:
        model_dir: a checkpoint directory.
        memo: the memo file (None: :func:`memo_path`).

    Returns:
        A :class:`CheckpointDigest`.

    Raises:
        CheckpointError: as :func:`~mmserve.model.weights.weight_files`.
        OSError: a file that cannot be read.
    """
    t0 = time.perf_counter()
    model_dir = Path(model_dir)
    memo = memo_path() if memo is None else memo
    with _memo_lock:
        known = _load_memo(memo)
        h = xxhash.xxh3_128()
        h.update(f"mmserve-checkpoint-v{IDENTITY_VERSION}".encode())
        updates: dict[str, Any] = {}
        total = read = hits = 0
        files = checkpoint_files(model_dir)
        for rel, p in files:
            st = os.stat(p)
            stat = _stat_key(st)
            digest = _remembered(known.get(str(p)), stat)
            if digest is not None:
                hits += 1
            else:
                digest, n = _hash_file(p)
                read += n
                if _stat_key(os.stat(p)) == stat:  # not changed while read: remember it
                    updates[str(p)] = {"stat": stat, "digest": digest.hex()}
            total += st.st_size
            h.update(f"{rel}|{st.st_size}|".encode())
            h.update(digest)
        if updates:
            _save_memo(memo, updates)
    return CheckpointDigest(h.digest(), len(files), total, read, hits, time.perf_counter() - t0)


def _model_tensors(model: LoadedModel) -> list[tuple[str, torch.Tensor]]:
    named = list(model.decoder.named_parameters()) + list(model.decoder.named_buffers())
    vision = getattr(model, "vision", None)
    if vision is not None and hasattr(vision, "named_parameters"):
        named += [("vision." + n, t) for n, t in vision.named_parameters()]
        named += [("vision." + n, t) for n, t in vision.named_buffers()]
    return named


def _text(obj: Any) -> str:
    """Settings of a config, tokenizer or processor as text (their JSON where they have one)."""
    for attr in ("to_json_string",):
        fn = getattr(obj, attr, None)
        if callable(fn):
            try:
                return str(fn())
            except Exception:  # noqa: BLE001 - transformers' serializers raise many kinds
                break
    return repr(obj)


def _processor_text(processor: Any) -> str:
    """The tokenizer (its whole vocabulary and rules), chat template and image processor."""
    parts = []
    tok = getattr(processor, "tokenizer", None)
    if tok is not None:
        backend = getattr(tok, "backend_tokenizer", None)
        parts.append(backend.to_str() if backend is not None else repr(sorted(tok.get_vocab())))
        parts.append(str(getattr(tok, "chat_template", None)))
    parts.append(str(getattr(processor, "chat_template", None)))
    for attr in ("image_processor", "video_processor"):
        sub = getattr(processor, attr, None)
        if sub is not None:
            parts.append(_text(sub))
    return "\n".join(parts)


def checkpoint_identity(
    model_dir: str | Path, dtype: torch.dtype, quantization: str = "none"
) -> bytes:
    """The 16-byte identity of the model served from ``model_dir`` in ``dtype`` with
    ``quantization``: :func:`checkpoint_digest` (every byte of its files) plus both
    settings; what :func:`model_identity` gives a model loaded from it. Logged (digest,
    files, bytes read, memo hits, seconds).

    The encoder deployment keys features on it with ``quantization="none"`` (the vision
    tower is never quantized), the ingress keys the replica router's trees on it. Within
    one process the answer is remembered (and logged) once per directory, settings and
    file stats: a second caller (a replica's engine and its encoder client) stats the
    files only.

    Raises:
        CheckpointError, OSError: the checkpoint's files cannot be listed or read.
    """
    base = Path(model_dir).resolve()
    stats = tuple((rel, *_stat_key(os.stat(p))) for rel, p in checkpoint_files(base))
    seen = (str(base), str(dtype), quantization, stats)
    if (known := _identities.get(seen)) is not None:
        return known
    d = checkpoint_digest(model_dir)
    h = xxhash.xxh3_128()
    h.update(f"mmserve-model-v{IDENTITY_VERSION}|".encode())
    h.update(d.digest)
    h.update(f"|dtype={dtype}|quantization={quantization}".encode())
    ident = h.digest()
    log.info(
        "model identity %s: %d files of %s (%.1f MB), %.1f MB read, %d from the memo, %.2f s",
        ident.hex(),
        d.files,
        model_dir,
        d.bytes_total / 1e6,
        d.bytes_read / 1e6,
        d.memo_hits,
        d.seconds,
    )
    _identities[seen] = ident
    return ident


def model_identity(model: LoadedModel) -> bytes:
    """The 16-byte identity of ``model`` (see the module docstring), computed once per
    loaded model and logged once (digest, bytes read, seconds, how many files came from
    the memo).

    A model loaded from a directory (``model.source``) is identified by its files
    (:func:`checkpoint_identity`); one built in memory by every byte of its tensors and
    its config and processor settings. Both add the compute dtype and the quantization.

    Raises:
        CheckpointError, OSError: the checkpoint's files cannot be listed or read.
    """
    if model.identity is not None:
        return model.identity
    dtype = token_embedding(model.decoder).weight.dtype
    if model.source is not None:
        model.identity = checkpoint_identity(model.source, dtype, model.quantization)
        return model.identity
    t0 = time.perf_counter()
    named = _model_tensors(model)
    text = _text(model.config) + "\n" + _processor_text(model.processor)
    h = xxhash.xxh3_128()
    h.update(f"mmserve-model-v{IDENTITY_VERSION}|".encode())
    h.update(model_fingerprint(text, named))
    h.update(f"|dtype={dtype}|quantization={model.quantization}".encode())
    ident = h.digest()
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    log.info(
        "model identity %s: %d tensors in memory (%.1f MB) read, no files, %.2f s",
        ident.hex(),
        len(named),
        nbytes / 1e6,
        time.perf_counter() - t0,
    )
    model.identity = ident
    return ident
