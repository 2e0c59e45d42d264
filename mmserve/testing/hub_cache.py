"""A checkpoint directory laid out as a Hugging Face Hub cache entry, for offline tests.

``huggingface_hub`` keeps a repository ``org/name`` under
``<cache>/models--org--name/``: ``blobs/<etag>`` (a file's content, named by its git
blob SHA-1, or the SHA-256 of an LFS file such as a safetensors one),
``snapshots/<commit>/<file>`` (relative symlinks into ``blobs/``) and
``refs/<branch>`` (the commit a branch or tag points at). :func:`write_hub_cache` writes
that, so ``snapshot_download(..., local_files_only=True)`` (or ``HF_HUB_OFFLINE=1``)
finds the model by id without a network. ``mmserve make-model DIR --hub-cache CACHE
--repo-id org/name`` calls it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

__all__ = ["write_hub_cache"]


def _etag(path: Path) -> str:
    """The name ``huggingface_hub`` gives the blob: SHA-256 for LFS-stored weights, else
    the git blob SHA-1 of the bytes."""
    data = path.read_bytes()
    if path.suffix == ".safetensors":
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write_hub_cache(
    model_dir: str | Path,
    cache_dir: str | Path,
    repo_id: str,
    revision: str = "main",
    commit: str | None = None,
) -> Path:
    """Copy the files of ``model_dir`` into ``cache_dir`` as the Hub cache holds
    ``repo_id`` at ``revision``.

    Args:
        model_dir: a checkpoint directory (its top-level files and sub-folders are copied).
        cache_dir: the Hub cache root (``HF_HOME/hub``, ``HF_HUB_CACHE`` or
            ``--download-dir``); created if missing.
        repo_id: ``org/name``.
        revision: the branch or tag whose ref points at the snapshot.
        commit: the 40-hex commit id; None: a SHA-1 of the files' names and blob names
            (the same files give the same commit).

    Returns:
        The snapshot directory (``models--org--name/snapshots/<commit>``).

    Raises:
        ValueError: for a ``commit`` that is not 40 hex digits or a missing ``model_dir``.
    """
    src = Path(model_dir)
    if not src.is_dir():
        raise ValueError(f"{src} is not a directory")
    files = sorted(p for p in src.rglob("*") if p.is_file())
    etags = {p.relative_to(src).as_posix(): _etag(p) for p in files}
    if commit is None:
        listing = "".join(f"{name}\0{tag}\n" for name, tag in etags.items())
        commit = hashlib.sha1(listing.encode()).hexdigest()
    if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
        raise ValueError(f"commit must be 40 lower-case hex digits; got {commit!r}")
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    for p in files:
        name = p.relative_to(src).as_posix()
        blob = blobs / etags[name]
        if not blob.exists():
            shutil.copyfile(p, blob)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    refs = repo / "refs" / revision
    refs.parent.mkdir(parents=True, exist_ok=True)
    refs.write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot
