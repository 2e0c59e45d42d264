"""One batch job: its OpenAI batch object, its status transitions (one table) and its
output and error files.

State lives under ``--data-dir``: ``batches/<id>/state.json`` (the batch object and the
file ids reserved for its output, written atomically at each status change and at
most a second apart while lines finish) and ``output.jsonl`` / ``errors.jsonl``,
appended as each line finishes. Output and error lines have OpenAI's format:
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import IO

from api.batch.store import new_file_id
from api.commit import fsync_dir
from api.endpoints.base import Usage

log = logging.getLogger(__name__)

#: Each status and the statuses a batch may move to from it; nothing else happens.
#: ``failed``: the input file went missing, or the runner hit an internal error.
#: A cancel is accepted until ``finalizing``: an accepted one always ends ``cancelled``
#: (even if every line had run), and ``finalizing`` always ends ``completed``.
TRANSITIONS: dict[str, frozenset[str]] = {
    "validating": frozenset({"in_progress", "cancelling", "failed"}),
    "in_progress": frozenset({"finalizing", "cancelling", "expired", "failed"}),
    "cancelling": frozenset({"cancelled", "expired", "failed"}),
    "finalizing": frozenset({"completed", "failed"}),
    "completed": frozenset(),
    "failed": frozenset(),
    "expired": frozenset(),
    "cancelled": frozenset(),
}
#: Statuses after which a batch never changes again.
TERMINAL = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)
#: Validation errors listed in the batch object's ``errors`` (all are in the error file).
MAX_LISTED_ERRORS = 100
#: The completion window (OpenAI offers only this one).
WINDOW_SECONDS = 24 * 3600


def usage_object(usage: Usage) -> dict:
    """A batch's ``usage`` object (OpenAI's Responses-style token counts)."""
    return {
        "input_tokens": usage.input,
        "input_tokens_details": {"cached_tokens": usage.cached},
        "output_tokens": usage.output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.input + usage.output,
    }


def batch_error(code: str, message: str, param: str | None = None) -> dict:
    """An entry of a batch's ``errors.data`` that names no line."""
    return {"code": code, "message": message, "line": None, "param": param}


class BatchJob:
    """A batch: its OpenAI object (:attr:`obj`, what the routes answer), the file ids
    reserved for its output and error files, and its directory. Its status changes only
    through :meth:`move` (event-loop thread only).

    Cancel rule: a cancel is accepted (``cancelling``, ``cancelling_at`` stamped) only
    before ``finalizing``, and an accepted cancel always ends ``cancelled``, even when
    it arrived after the last line ran but before the runner moved on. Once
    ``finalizing`` (every line has run) the batch always ends ``completed``: a cancel
    is refused as for an ended batch (409 ``batch_not_cancellable``), and
    ``cancelling_at`` stays null.

    Args:
        obj: the batch object.
        reserved: ``{"output": file id, "error": file id}``.
        root: the directory holding every batch's directory.
    """

    def __init__(self, obj: dict, reserved: dict[str, str], root: Path) -> None:
        self.obj = obj
        self.reserved = reserved
        self.dir = root / obj["id"]
        self._usage = Usage(
            obj["usage"]["input_tokens"],
            obj["usage"]["input_tokens_details"]["cached_tokens"],
            obj["usage"]["output_tokens"],
        )

    @classmethod
    def new(
        cls, root: Path, endpoint: str, model: str, input_file_id: str, metadata: dict | None
    ) -> BatchJob:
        """A new batch (status ``validating``) with fresh ids."""
        now = int(time.time())
        obj = {
            "id": f"batch_{uuid.uuid4().hex[:24]}",
            "object": "batch",
            "endpoint": endpoint,
            "model": model,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": "24h",
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + WINDOW_SECONDS,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "usage": usage_object(Usage(0, 0, 0)),
            "metadata": metadata,
        }
        return cls(obj, {"output": new_file_id(), "error": new_file_id()}, root)

    @classmethod
    def load(cls, path: Path) -> BatchJob:
        """The job saved in ``path`` (a ``state.json``; blocking IO).

        Raises:
            OSError, ValueError: an unreadable file.
        """
        saved = json.loads(path.read_text(encoding="utf-8"))
        return cls(saved["batch"], saved["reserved"], path.parent.parent)

    @property
    def id(self) -> str:
        """The batch id."""
        return self.obj["id"]

    @property
    def status(self) -> str:
        """The current status."""
        return self.obj["status"]

    @property
    def ended(self) -> bool:
        """Whether the status is terminal."""
        return self.status in TERMINAL

    def move(self, status: str) -> None:
        """Change the status to ``status`` and stamp ``<status>_at``.

        Raises:
            ValueError: for a move :data:`TRANSITIONS` does not allow.
        """
        if status not in TRANSITIONS[self.status]:
            raise ValueError(f"batch {self.id}: no move from {self.status!r} to {status!r}")
        self.obj["status"] = status
        self.obj[f"{status}_at"] = int(time.time())

    def fail(self, code: str, message: str, param: str | None = None) -> None:
        """End as ``failed``, with one batch-level error."""
        self.move("failed")
        self.obj["errors"] = {"object": "list", "data": [batch_error(code, message, param)]}

    def validated(self, invalid: list[dict]) -> None:
        """List the first invalid lines' errors (none: null) and start running, unless
        the batch was cancelled meanwhile."""
        data = [dict(r["error"]) for r in invalid[:MAX_LISTED_ERRORS]]
        self.obj["errors"] = {"object": "list", "data": data} if invalid else None
        if self.status == "validating":
            self.move("in_progress")

    def interrupted(self) -> str | None:
        """The status the running batch must end with now (``cancelled`` when asked to,
        ``expired`` past its window), or None to go on."""
        if self.status == "cancelling":
            return "cancelled"
        if time.time() > self.obj["expires_at"]:
            return "expired"
        return None

    def recount(self, total: int, usages: list[Usage], failed: int) -> None:
        """Set the counts and usage from what is on disk: ``total`` lines, the usage of
        each completed one, ``failed`` error records."""
        self._usage = Usage(*(sum(u[k] for u in usages) for k in range(3)))
        self.obj["usage"] = usage_object(self._usage)
        self.obj["request_counts"] = {
            "total": total,
            "completed": len(usages),
            "failed": failed,
        }

    def count(self, usage: Usage | None) -> None:
        """Count one finished line: completed with ``usage``, or failed (None)."""
        counts = self.obj["request_counts"]
        if usage is None:
            counts["failed"] += 1
            return
        counts["completed"] += 1
        self._usage = Usage(*(a + b for a, b in zip(self._usage, usage, strict=True)))
        self.obj["usage"] = usage_object(self._usage)

    def snapshot(self) -> bytes:
        """What ``state.json`` holds, as of now (taken on the event loop, written off it)."""
        return json.dumps({"batch": self.obj, "reserved": self.reserved}).encode("utf-8")


def read_records(path: Path) -> list[dict]:
    """The complete records of an output or error file; a torn last line (a crash in
    the middle of a write) is cut off the file so that appending continues cleanly
    (blocking IO)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    out = []
    for text in data[:end].split(b"\n"):
        if text.strip():
            try:
                out.append(json.loads(text))
            except ValueError:  # unreachable unless the disk lies; the line is rerun
                log.warning("skipping an unreadable line in %s", path)
    return out


class Outputs:
    """A running batch's output and error files, appended to (blocking IO: the runner
    calls every method on its one IO thread, in order).

    Args:
        d: the batch's directory (created if missing).
        fresh: empty both files first (nothing has run yet).
    """

    def __init__(self, d: Path, fresh: bool) -> None:
        d.mkdir(parents=True, exist_ok=True)
        self.dir = d
        if fresh:
            for name in ("output.jsonl", "errors.jsonl"):
                (d / name).write_bytes(b"")
        self.out: IO[str] = open(d / "output.jsonl", "a", encoding="utf-8")
        self.err: IO[str] = open(d / "errors.jsonl", "a", encoding="utf-8")
        self.last_sync = time.monotonic()

    def write(self, record: dict, ok: bool) -> None:
        """Append ``record`` to the output file (``ok``) or the error file."""
        f = self.out if ok else self.err
        f.write(json.dumps(record) + "\n")
        f.flush()

    def start(self, invalid: list[dict]) -> None:
        """Write the validation error records and make the new files durable."""
        for rec in invalid:
            self.write(rec, ok=False)
        self.sync()
        fsync_dir(self.dir)

    def records(self) -> tuple[list[dict], list[dict]]:
        """The output and error records on disk (:func:`read_records`)."""
        return read_records(self.dir / "output.jsonl"), read_records(self.dir / "errors.jsonl")

    def sync(self) -> None:
        """fsync both files."""
        for f in (self.out, self.err):
            f.flush()
            os.fsync(f.fileno())
        self.last_sync = time.monotonic()

    def close(self) -> None:
        """Sync and close both files."""
        self.sync()
        self.out.close()
        self.err.close()
