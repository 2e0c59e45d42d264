"""``--model org/name``: a Hugging Face Hub id resolved to a local snapshot directory.

A model argument that is an existing directory is used as it is. Anything else shaped
like a Hub id (``name`` or ``org/name``) is fetched with ``huggingface_hub``'s
``snapshot_download`` at ``revision``, limited to the files the loader reads
(:data:`ALLOW_PATTERNS`: config, processor, tokenizer and chat-template files, the
safetensors weights and their index; never ``.bin`` or other pickles), into
``download_dir`` or the Hub cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``). The
environment is read at each call (``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``,
``HF_TOKEN``, ``HF_ENDPOINT``), so a process that changes it sees the change.

Resolution runs once, in the process that parses ``--model`` (the API process); the
snapshot path is what engines, tensor-parallel ranks and replicas are handed, so no
other process resolves or downloads. Every failure (unknown id, unknown revision, a gated
or private repository, an unreachable Hub, a partial cache) is a :class:`HubModelError`
whose message is one line naming the id and revision and what to do, raised before any
weight is read.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmserve.config import EngineConfig

log = logging.getLogger(__name__)

#: Files a snapshot download fetches: what :mod:`mmserve.model.loader` and the processors
#: read. ``*.json`` covers config, generation, processor, preprocessor, video
#: preprocessor, tokenizer, special-tokens and the safetensors index files.
ALLOW_PATTERNS = (
    "*.json",
    "*.safetensors",
    "*.jinja",
    "tokenizer.model",
    "merges.txt",
    "additional_chat_templates/*",
)
#: Files left out although an allow pattern matches them (``*`` matches ``/`` there):
#: weights and configs in sub-folders (ONNX exports, originals) are not this model's.
IGNORE_PATTERNS = ("*/*.safetensors", "*/*.json")

#: A Hub repository id: ``name`` or ``org/name`` of letters, digits, ``-``, ``_``, ``.``.
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")


class HubModelError(ValueError):
    """A model argument that names no local directory and no reachable Hub snapshot; the
    message is one line (id, revision, what to do)."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files came from.

    Attributes:
        path: the local directory the loader reads (a snapshot for a Hub id).
        repo_id: the Hub id, None for a directory given as a path.
        revision: the revision asked for (branch, tag or commit; "main" by default).
        commit: the commit the revision resolved to (the snapshot folder's name).
    """

    path: Path
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None

    def describe(self) -> str:
        """In words, for the start-up log."""
        if self.repo_id is None:
            return str(self.path)
        return (
            f"Hugging Face Hub {self.repo_id} (revision {self.revision}, commit "
            f"{self.commit}) at {self.path}"
        )


#: Snapshots resolved in this process, by their local path (the start-up log reads it).
_RESOLVED: dict[str, ModelSource] = {}


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_cache_dir(download_dir: str | None = None) -> Path:
    """Where snapshots go: ``download_dir``, else ``HF_HUB_CACHE``, else ``HF_HOME/hub``,
    else ``~/.cache/huggingface/hub`` (read from the environment now)."""
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home).expanduser() / "hub"


def _cached_why(cache: Path, repo_id: str, revision: str) -> str:
    """Why an offline look-up found nothing: the id or the revision is not in ``cache``."""
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    if not folder.is_dir():
        return f"{repo_id} is not in the Hub cache {cache}"
    return f"revision {revision!r} of {repo_id} is not in the Hub cache {cache}"


def resolve_model(
    model: str, revision: str | None = None, download_dir: str | None = None
) -> ModelSource:
    """The local directory of ``model``: itself when it is a path, else a Hub snapshot.

    Args:
        model: a checkpoint directory or a Hub id (``org/name``).
        revision: branch, tag or commit of a Hub id (None: "main"); refused with a path.
        download_dir: Hub cache folder for a Hub id (None: ``HF_HUB_CACHE`` /
            ``HF_HOME/hub``).

    Returns:
        A :class:`ModelSource` (also remembered for :func:`source_of`).

    Raises:
        HubModelError: a path that does not exist and is no Hub id; a revision given
            with a path; an unknown id or revision (online or in an offline cache); a
            gated or private repository without access; an unreachable Hub with nothing
            cached; a partial snapshot. One line each.
    """
    path = Path(model).expanduser()
    if path.exists():
        if revision is not None:
            raise HubModelError(
                f"--revision {revision} applies to a Hub id, but --model {model} is a local path"
            )
        return ModelSource(path)
    if not _REPO_ID.match(model):
        raise HubModelError(
            f"--model {model}: no such directory, and not a Hugging Face Hub id (org/name)"
        )
    rev = revision or "main"
    cache = hub_cache_dir(download_dir)
    offline = _env_on("HF_HUB_OFFLINE")
    snapshot = _download(model, rev, cache, offline)
    source = ModelSource(Path(snapshot), model, rev, Path(snapshot).name)
    _RESOLVED[str(source.path)] = source
    log.info("model files: %s", source.describe())
    return source


def _download(repo_id: str, rev: str, cache: Path, offline: bool) -> str:
    """``snapshot_download`` with the errors turned into one-line :class:`HubModelError`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id} (revision {rev})"
    endpoint = os.environ.get("HF_ENDPOINT") or None
    try:
        return snapshot_download(
            repo_id,
            revision=rev,
            cache_dir=str(cache),
            allow_patterns=list(ALLOW_PATTERNS),
            ignore_patterns=list(IGNORE_PATTERNS),
            local_files_only=offline,
            token=os.environ.get("HF_TOKEN") or None,
            endpoint=endpoint,
        )
    except GatedRepoError:
        raise HubModelError(
            f"{where} is a gated repository: accept its terms on the Hub page and set "
            "HF_TOKEN to a token of that account"
        ) from None
    except RevisionNotFoundError:
        raise HubModelError(
            f"revision {rev!r} of {repo_id} does not exist on the Hub: pass an existing "
            "branch, tag or commit with --revision"
        ) from None
    except RepositoryNotFoundError:
        raise HubModelError(
            f"{where} was not found on the Hub: check the id, or set HF_TOKEN if the "
            "repository is private"
        ) from None
    except IncompleteSnapshotError as e:
        raise HubModelError(
            f"the cached snapshot of {where} is incomplete ({type(e).__name__}): run once "
            "with network access (HF_HUB_OFFLINE unset) to complete it"
        ) from None
    except LocalEntryNotFoundError as e:
        if offline:
            raise HubModelError(
                f"HF_HUB_OFFLINE is set and {_cached_why(cache, repo_id, rev)}: download "
                "it once with network access, or pass a local directory to --model"
            ) from None
        cause = e.__cause__ or e
        if isinstance(cause, HfHubHTTPError):  # the Hub answered, with an error (5xx)
            status = getattr(getattr(cause, "response", None), "status_code", "?")
            raise HubModelError(
                f"the Hub at {endpoint or 'https://huggingface.co'} answered HTTP {status} "
                f"for {where} and it is not in the cache {cache}: retry later, or set "
                "HF_HUB_OFFLINE=1 with a filled cache"
            ) from None
        raise HubModelError(
            f"cannot reach the Hugging Face Hub at {endpoint or 'https://huggingface.co'} "
            f"for {where} ({type(cause).__name__}) and it is not in the cache {cache}: "
            "check the network, or set HF_HUB_OFFLINE=1 with a filled cache"
        ) from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", "?")
        raise HubModelError(
            f"the Hub answered HTTP {status} for {where}: check HF_TOKEN and the id"
        ) from None
    except OSError as e:  # a cache folder that cannot be written, a full disk
        raise HubModelError(f"cannot fetch {where} into {cache}: {e}") from None


def source_of(path: str | os.PathLike | None) -> str:
    """Where the files at ``path`` came from, in words: the Hub id, revision, commit and
    path when this process resolved it from an id, else the path."""
    if path is None:
        return "(no model)"
    found = _RESOLVED.get(str(Path(path)))
    return found.describe() if found is not None else str(path)


def resolve_config(config: EngineConfig) -> ModelSource | None:
    """Resolve ``config.model_path`` (:func:`resolve_model` with ``config.revision`` and
    ``config.download_dir``) and put the local directory in its place, so every process
    handed ``config`` after this reads the snapshot and resolves nothing; idempotent.

    Returns:
        The source, or None when ``model_path`` is unset.

    Raises:
        HubModelError: as :func:`resolve_model`.
    """
    if config.model_path is None:
        return None
    known = _RESOLVED.get(str(Path(config.model_path)))
    if known is not None:
        return known
    source = resolve_model(str(config.model_path), config.revision, config.download_dir)
    if source.repo_id is not None:
        config.model_path = str(source.path)
        config.revision = None  # the path is the snapshot; a revision names nothing now
    return source
