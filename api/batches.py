"""Durable batch jobs (OpenAI's Batch API) run in an order chosen for the prefix cache.

A batch is an uploaded JSONL file (``/v1/files``, purpose ``batch``) of requests
``{"custom_id", "method": "POST", "url", "body"}`` for ``/v1/chat/completions`` or
``/v1/responses``. :class:`BatchManager` runs batches one after another:

1. **Validation, up front.** Every line is parsed and its body validated as the route
   would (:func:`_validate`); a malformed line goes to the error file with its
   ``custom_id`` (when it has one) and line number, the others run.
2. **Cache-aware order** (``--batch-order cache``). The valid lines are sorted by their
   prompt as a sequence of segments (role, text, image URL hash) in prompt order;
   a lexicographic sort is a depth-first walk of the batch's own prefix trie, so
   requests about one image, or sharing a system prompt and history, run back to
   back and hit the radix cache (SGLang, Zheng et al. 2024, Theorem 3.1: a DFS order
   maximises the hit rate when the cache holds one root-to-leaf path).
3. **Bounded, low-priority execution.** At most ``--batch-max-in-flight`` requests are
   submitted at once through the same :class:`~api.submit.EngineClient` as online
   requests, and at most ``--batch-in-flight-with-online`` while any online request
   runs, so interactive traffic keeps its latency.
4. **Durable.** State lives under ``--data-dir``: ``batches/<id>/state.json``
   (written atomically at each status change and every second while running) and
   ``output.jsonl`` / ``errors.jsonl``, appended as each line finishes and fsync'd at
   most a second apart. After a crash or restart an unfinished batch resumes: lines
   whose result is on disk are not run again (a torn last line is cut off and its
   request rerun), so every ``custom_id`` appears once in the output and error files.

Output and error lines have OpenAI's format: ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import xxhash
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError

from api.batch_store import FileStore, fsync_dir, new_file_id, write_json_atomic
from api.errors import APIError, describe_validation_errors, error_body
from api.ids import BATCH
from api.json_body import parse_json_object
from api.openai_format import TokenText, chat_completion
from api.routes_chat import prepare_chat
from api.routes_responses import prepare_response, response_object
from api.schemas import ChatCompletionRequest, ResponsesRequest
from api.state import ServerState

log = logging.getLogger(__name__)

#: Endpoints a batch may target, and the body each one's lines carry.
ENDPOINTS: dict[str, type] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
}
#: Statuses after which a batch never changes again.
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
#: Seconds between fsyncs of the output files and saves of the state while running.
SYNC_INTERVAL = 1.0
#: Longest ``custom_id`` (characters).
MAX_CUSTOM_ID = 512
#: Validation errors listed in the batch object's ``errors`` (all are in the error file).
MAX_LISTED_ERRORS = 100
#: The completion window (OpenAI offers only this one).
WINDOW_SECONDS = 24 * 3600


@dataclass
class Line:
    """One valid request of a batch.

    Attributes:
        number: 1-based line number in the input file.
        custom_id: the client's id for it (unique in the batch).
        body: the validated request body.
        key: its prompt as segments, for the cache-aware order.
    """

    number: int
    custom_id: str
    body: ChatCompletionRequest | ResponsesRequest
    key: tuple


def _hash(text: str) -> str:
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogatepass"))


def prompt_key(body: ChatCompletionRequest | ResponsesRequest) -> tuple:
    """The prompt of ``body`` as ``(kind, value)`` segments in prompt order: a role, a
    text, an image or video (a hash of its URL). Sorting lines by it walks their prefix
    trie depth first."""
    segs: list[tuple[str, str]] = []

    def content(c: Any) -> None:
        if c is None or isinstance(c, str):
            segs.append(("t", c or ""))
            return
        for p in c:
            if p.type in ("text", "input_text", "output_text"):
                segs.append(("t", p.text or ""))
            elif p.type == "input_image":
                segs.append(("i", _hash(p.image_url or "")))
            else:
                src = p.image_url if p.type == "image_url" else p.video_url
                url = src if isinstance(src, str) else src.url if src is not None else ""
                segs.append(("i" if p.type == "image_url" else "v", _hash(url)))

    if isinstance(body, ResponsesRequest):
        if body.instructions:
            segs.append(("m", "system"))
            content(body.instructions)
        if isinstance(body.input, str):
            segs.append(("m", "user"))
            content(body.input)
        else:
            for m in body.input:
                segs.append(("m", "system" if m.role == "developer" else m.role))
                content(m.content)
    else:
        for m in body.messages:
            segs.append(("m", "system" if m.role == "developer" else m.role))
            content(m.content)
    return tuple(segs)


def _validation_record(
    number: int, custom_id: str | None, code: str, message: str, param: str | None = None
) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {
            "code": code,
            "message": f"line {number}: {message}",
            "line": number,
            "param": param,
        },
    }


def _validate(raw: bytes, endpoint: str, st: ServerState) -> tuple[list[Line], list[dict]]:
    """The valid lines of a batch input file, and an error record for each invalid one
    (not JSON, not an object, missing or repeated ``custom_id``, a ``method`` other than
    POST, a ``url`` other than the batch's endpoint, or a body the route would refuse).
    Blank lines are skipped."""
    model = ENDPOINTS[endpoint]
    lines: list[Line] = []
    errors: list[dict] = []
    seen: set[str] = set()
    for number, text in enumerate(raw.split(b"\n"), start=1):
        if not text.strip():
            continue
        try:
            obj = parse_json_object(text, st.settings.max_json_depth)
        except APIError as e:
            errors.append(_validation_record(number, None, "invalid_json", e.message))
            continue
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
            what = f"custom_id: expected a string of 1 to {MAX_CUSTOM_ID} characters"
            errors.append(_validation_record(number, None, "invalid_custom_id", what, "custom_id"))
            continue
        if cid in seen:
            what = f"custom_id: {cid!r} is used by an earlier line; each must be unique"
            errors.append(_validation_record(number, cid, "duplicate_custom_id", what, "custom_id"))
            continue
        seen.add(cid)
        stray = sorted(set(obj) - {"custom_id", "method", "url", "body"})
        problem: tuple[str, str, str | None] | None = None
        if stray:
            problem = ("invalid_request", f"{stray[0]}: unknown field", stray[0])
        elif obj.get("method") != "POST":
            problem = ("invalid_method", "method: only POST is supported", "method")
        elif obj.get("url") != endpoint:
            what = f"url: {obj.get('url')!r} is not the batch's endpoint {endpoint!r}"
            problem = ("mismatched_endpoint", what, "url")
        elif not isinstance(obj.get("body"), dict):
            problem = ("invalid_request", "body: expected an object", "body")
        if problem is None:
            try:
                body = model.model_validate(obj["body"])
                _check_body(body, st)
            except ValidationError as e:
                msg, param = describe_validation_errors(e.errors())
                param = f"body.{param}" if param else "body"
                problem = ("invalid_request", f"body.{msg}", param)
            except APIError as e:
                param = f"body.{e.param}" if e.param else "body"
                problem = ("invalid_request", f"body: {e.message}", param)
        if problem is not None:
            errors.append(_validation_record(number, cid, *problem))
            continue
        lines.append(Line(number, cid, body, prompt_key(body)))
    return lines, errors


def _check_body(body: ChatCompletionRequest | ResponsesRequest, st: ServerState) -> None:
    """What the routes check beyond the schema and cannot honour in a batch.

    Raises:
        APIError: for ``stream`` set, another model, or ``n`` over the limit.
    """
    if body.stream:
        raise APIError(400, "stream: not available in a batch (set it false)", param="stream")
    if body.model is not None and body.model != st.model_name:
        raise APIError(400, f"model: this server serves {st.model_name!r}", param="model")
    if isinstance(body, ChatCompletionRequest):
        if (body.n or 1) > st.settings.max_n:
            raise APIError(400, f"n: the limit is {st.settings.max_n}", param="n")
        if body.stream_options is not None:
            raise APIError(400, "stream_options: not used without stream", param="stream_options")


def _read_records(path: Path) -> list[dict]:
    """The complete records of an output or error file; a torn last line (a crash in
    the middle of a write) is cut off the file so that appending continues cleanly."""
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


def _usage_of(body: dict) -> tuple[int, int, int]:
    """``(input, cached, output)`` tokens of a chat completion or response body."""
    u = body.get("usage") or {}
    if "input_tokens" in u:
        cached = (u.get("input_tokens_details") or {}).get("cached_tokens", 0)
        return u["input_tokens"], cached, u["output_tokens"]
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return u.get("prompt_tokens", 0), cached, u.get("completion_tokens", 0)


class _Job:
    """A running batch's open files and counters (event-loop thread only)."""

    def __init__(self, d: Path) -> None:
        self.out: IO[str] = open(d / "output.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self.err: IO[str] = open(d / "errors.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self.last_sync = time.monotonic()

    def write(self, record: dict, ok: bool) -> None:
        f = self.out if ok else self.err
        f.write(json.dumps(record) + "\n")
        f.flush()

    def sync(self) -> None:
        for f in (self.out, self.err):
            f.flush()
            os.fsync(f.fileno())
        self.last_sync = time.monotonic()

    def close(self) -> None:
        self.sync()
        self.out.close()
        self.err.close()


class BatchManager:
    """Keeps, runs and resumes the server's batches.

    Args:
        st: the server's state (engine client, settings, media resolver).
        files: the file store the input and output files live in.
        ready: awaited before a batch's lines run (after validation): the replica
            ingress waits there until a replica is healthy, so a batch resumed at
            start-up does not fail lines while the replicas are still loading.
    """

    def __init__(
        self,
        st: ServerState,
        files: FileStore,
        ready: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.st = st
        self.files = files
        self._ready = ready
        self.dir = files.dir.parent / "batches"
        self.batches: dict[str, dict] = {}
        self._reserved: dict[str, dict[str, str]] = {}
        self._queue: asyncio.Queue[str] | None = None
        self._worker: asyncio.Task | None = None
        if self.dir.is_dir():
            for state in self.dir.glob("batch_*/state.json"):
                try:
                    saved = json.loads(state.read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    log.warning("unreadable batch state %s", state)
                    continue
                b = saved["batch"]
                self.batches[b["id"]] = b
                self._reserved[b["id"]] = saved["reserved"]

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker (on the event loop) and queue every unfinished batch."""
        self._queue = asyncio.Queue()
        for b in sorted(self.batches.values(), key=lambda b: (b["created_at"], b["id"])):
            if b["status"] not in TERMINAL:
                self._queue.put_nowait(b["id"])
        self._worker = asyncio.ensure_future(self._work())

    async def stop(self) -> None:
        """Stop the worker; requests in flight are aborted and rerun after a restart."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker

    # ---- API ----------------------------------------------------------------------------
    def create(self, input_file_id: str, endpoint: str, metadata: dict | None) -> dict:
        """A new batch over ``input_file_id`` (status ``validating``), queued to run.

        Raises:
            APIError: 400 for an unknown endpoint, a file that is not a batch input or
                has more lines than ``max_batch_lines`` or a malformed ``input_file_id``;
                404 for an unknown file.
        """
        if endpoint not in ENDPOINTS:
            raise APIError(
                400,
                f"endpoint: {endpoint!r} is not supported; use one of {sorted(ENDPOINTS)}",
                param="endpoint",
            )
        info = self.files.get(input_file_id, "input_file_id", 400)
        if info["purpose"] != "batch":
            raise APIError(
                400,
                f"input_file_id: file {input_file_id!r} has purpose {info['purpose']!r}, "
                "not 'batch'",
                param="input_file_id",
            )
        raw = self.files.read(input_file_id)
        check_lines(raw, self.st.settings.max_batch_lines, "input_file_id")
        now = int(time.time())
        bid = f"batch_{uuid.uuid4().hex[:24]}"
        b = {
            "id": bid,
            "object": "batch",
            "endpoint": endpoint,
            "model": self.st.model_name,
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
            "usage": _usage_obj(0, 0, 0),
            "metadata": metadata,
        }
        self.batches[bid] = b
        self._reserved[bid] = {"output": new_file_id(), "error": new_file_id()}
        (self.dir / bid).mkdir(parents=True, exist_ok=True)
        self._save(bid)
        if self._queue is not None:
            self._queue.put_nowait(bid)
        return b

    def get(self, batch_id: str) -> dict:
        """The batch object of ``batch_id``.

        Raises:
            APIError: 404 for an unknown or malformed id.
        """
        return BATCH.find(batch_id, "batch_id", self.batches.get, 404)

    def list(self) -> list[dict]:
        """Batch objects, newest first."""
        return sorted(self.batches.values(), key=lambda b: (b["created_at"], b["id"]), reverse=True)

    def cancel(self, batch_id: str) -> dict:
        """Ask a batch to stop: ``cancelling`` now, ``cancelled`` once its in-flight
        requests are aborted (finished lines keep their results in the output files).

        Raises:
            APIError: 404 for an unknown id; 409 for a batch that already ended.
        """
        b = self.get(batch_id)
        if b["status"] in TERMINAL:
            raise APIError(
                409,
                f"batch {batch_id!r} is already {b['status']}; it cannot be cancelled",
                code="batch_not_cancellable",
            )
        if b["status"] != "cancelling":
            b["status"] = "cancelling"
            b["cancelling_at"] = int(time.time())
            self._save(batch_id)
        return b

    def uses_file(self, file_id: str) -> bool:
        """Whether an unfinished batch reads ``file_id``."""
        return any(
            b["input_file_id"] == file_id and b["status"] not in TERMINAL
            for b in self.batches.values()
        )

    # ---- running ------------------------------------------------------------------------
    def _save(self, bid: str) -> None:
        write_json_atomic(
            self.dir / bid / "state.json",
            {"batch": self.batches[bid], "reserved": self._reserved[bid]},
        )

    async def _work(self) -> None:
        assert self._queue is not None
        while True:
            bid = await self._queue.get()
            try:
                await self._run(bid)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one broken batch must not stop the others
                log.exception("batch %s failed", bid)
                b = self.batches[bid]
                b["status"], b["failed_at"] = "failed", int(time.time())
                b["errors"] = {
                    "object": "list",
                    "data": [_batch_error("server_error", "internal error; see the server log")],
                }
                self._save(bid)

    async def _run(self, bid: str) -> None:
        b = self.batches[bid]
        if b["status"] in TERMINAL:
            return
        d = self.dir / bid
        d.mkdir(parents=True, exist_ok=True)
        if b["status"] == "cancelling":
            await self._finalize(bid, "cancelled")
            return
        if b["status"] == "finalizing":
            await self._finalize(bid, "completed")
            return
        try:  # file reading and validation off the event loop (up to 64 MiB, 50k lines)
            raw = await run_in_threadpool(self.files.read, b["input_file_id"])
        except APIError:
            b["status"], b["failed_at"] = "failed", int(time.time())
            b["errors"] = {
                "object": "list",
                "data": [
                    _batch_error(
                        "input_file_missing", "the input file was deleted", "input_file_id"
                    )
                ],
            }
            self._save(bid)
            return
        lines, invalid = await run_in_threadpool(_validate, raw, b["endpoint"], self.st)
        if b["status"] == "validating":
            for name in ("output.jsonl", "errors.jsonl"):  # nothing has run yet
                (d / name).write_bytes(b"")
            job = _Job(d)
            for rec in invalid:
                job.write(rec, ok=False)
            job.sync()
            fsync_dir(d)
            b["errors"] = (
                {
                    "object": "list",
                    "data": [dict(r["error"]) for r in invalid[:MAX_LISTED_ERRORS]],
                }
                if invalid
                else None
            )
            b["status"], b["in_progress_at"] = "in_progress", int(time.time())
            self._save(bid)
        else:
            job = _Job(d)
        done = self._recount(b, d, len(lines) + len(invalid))
        todo = [ln for ln in lines if ln.custom_id not in done]
        if self.st.settings.batch_order == "cache":
            todo.sort(key=lambda ln: ln.key)
        if todo and self._ready is not None:
            await self._ready()
        try:
            ended = await self._execute(bid, todo, job)
        finally:
            job.close()
            self._save(bid)
        await self._finalize(bid, ended)

    def _recount(self, b: dict, d: Path, total: int) -> set[str]:
        """Counts and usage from the files on disk; the custom ids already answered."""
        outs = _read_records(d / "output.jsonl")
        errs = _read_records(d / "errors.jsonl")
        inp = cached = outp = 0
        for r in outs:
            i, c, o = _usage_of(r["response"]["body"])
            inp, cached, outp = inp + i, cached + c, outp + o
        b["usage"] = _usage_obj(inp, cached, outp)
        b["request_counts"] = {"total": total, "completed": len(outs), "failed": len(errs)}
        # validation records (no response) name lines that never run, not answered ones
        return {r["custom_id"] for r in outs + errs if r.get("response") is not None}

    async def _execute(self, bid: str, todo: list[Line], job: _Job) -> str:
        """Run ``todo`` with a bounded window; the status the batch ends with."""
        b = self.batches[bid]
        s = self.st.settings
        running: set[asyncio.Task] = set()
        ended = "completed"
        try:
            for line in todo:
                while True:
                    ended = self._interrupted(b) or ended
                    if ended != "completed":
                        break
                    limit = s.batch_max_in_flight
                    if self.st.client.online:
                        limit = min(limit, s.batch_in_flight_with_online)
                    if len(running) < limit:
                        break
                    _, running = await asyncio.wait(
                        running, timeout=0.05, return_when=asyncio.FIRST_COMPLETED
                    )
                    self._tick(bid, job)
                if ended != "completed":
                    break
                running.add(asyncio.ensure_future(self._one(b, line, job)))
            while running and ended == "completed":
                _, running = await asyncio.wait(
                    running, timeout=0.05, return_when=asyncio.FIRST_COMPLETED
                )
                self._tick(bid, job)
                ended = self._interrupted(b) or ended
        finally:
            for t in running:
                t.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
        return ended

    def _interrupted(self, b: dict) -> str | None:
        if b["status"] == "cancelling":
            return "cancelled"
        if time.time() > b["expires_at"]:
            return "expired"
        return None

    def _tick(self, bid: str, job: _Job) -> None:
        if time.monotonic() - job.last_sync >= SYNC_INTERVAL:
            job.sync()
            self._save(bid)

    async def _one(self, b: dict, line: Line, job: _Job) -> None:
        """Run one line and append its record (output or error file)."""
        record_id = f"batch_req_{uuid.uuid4().hex}"
        try:
            body, request_id = await self._answer(b["endpoint"], line)
            status = 200
        except APIError as e:
            body = error_body(e.message, e.type, e.param, e.code)
            request_id, status = f"req_{uuid.uuid4().hex}", e.status
        except Exception:  # noqa: BLE001 - recorded as failed, never silently lost
            log.exception("batch %s: line %s failed", b["id"], line.custom_id)
            body = error_body("internal error; see the server log", "server_error", None, None)
            request_id, status = f"req_{uuid.uuid4().hex}", 500
        record = {
            "id": record_id,
            "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None,
        }
        job.write(record, ok=status == 200)
        counts = b["request_counts"]
        if status == 200:
            counts["completed"] += 1
            i, c, o = _usage_of(body)
            u = b["usage"]
            b["usage"] = _usage_obj(
                u["input_tokens"] + i,
                u["input_tokens_details"]["cached_tokens"] + c,
                u["output_tokens"] + o,
            )
        else:
            counts["failed"] += 1

    async def _answer(self, endpoint: str, line: Line) -> tuple[dict, str]:
        """The response body of one line and its request id.

        Raises:
            APIError: what the route would answer (400 for bad media, 500 for an engine
                failure).
        """
        st = self.st
        created = time.time()
        if endpoint == "/v1/chat/completions":
            reqs, params, tools = await prepare_chat(st, line.body)
        else:
            reqs = await prepare_response(st, line.body)
        sub = await self._submit(reqs)
        try:
            results = await sub.answers()
        finally:
            sub.cancel()
        if endpoint == "/v1/chat/completions":
            cid = f"chatcmpl-{uuid.uuid4().hex}"
            tok = None
            if params.logprobs is not None:  # the byte table is built once, off the event loop
                tok = await run_in_threadpool(TokenText, st.engine.model.tokenizer)
            return chat_completion(cid, int(created), st.model_name, results, tok, tools), cid
        rid, msg_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        return response_object(st, line.body, rid, msg_id, created, results[0]), rid

    async def _submit(self, reqs: list):  # noqa: ANN202
        """Submit as background work, waiting while the engine's queue is full."""
        while True:
            try:
                return self.st.client.submit(reqs, background=True)
            except APIError as e:
                if e.status != 503:
                    raise
                await asyncio.sleep(0.05)

    async def _finalize(self, bid: str, status: str) -> None:
        """Publish the output and error files and end the batch with ``status``."""
        b = self.batches[bid]
        d = self.dir / bid
        now = int(time.time())
        if status == "completed" and b["status"] != "finalizing":
            b["status"], b["finalizing_at"] = "finalizing", now
            self._save(bid)
        reserved = self._reserved[bid]
        for kind, name, purpose in (
            ("output", "output.jsonl", "batch_output"),
            ("error", "errors.jsonl", "batch_output"),
        ):
            fid = reserved[kind]
            src, dst = d / name, self.files.path(fid)
            if src.exists() and src.stat().st_size > 0:
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.replace(src, dst)
                fsync_dir(dst.parent)
            if dst.exists():
                try:
                    self.files.get(fid)
                except APIError:
                    self.files.register(fid, f"{bid}_{kind}.jsonl", purpose)
                b[f"{kind}_file_id"] = fid
        b["status"] = status
        b[f"{status}_at"] = int(time.time())
        self._save(bid)


def _batch_error(code: str, message: str, param: str | None = None) -> dict:
    return {"code": code, "message": message, "line": None, "param": param}


def _usage_obj(inp: int, cached: int, out: int) -> dict:
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": inp + out,
    }


def check_lines(raw: bytes, max_lines: int, param: str) -> int:
    """The number of non-blank lines of a batch file.

    Raises:
        APIError: 400 naming ``param`` when the file is not UTF-8 or has more than
            ``max_lines`` requests.
    """
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"{param}: not UTF-8 text (byte {e.start})", param=param) from None
    n = sum(1 for t in raw.split(b"\n") if t.strip())
    if n > max_lines:
        raise APIError(
            400,
            f"{param}: {n} requests; the limit is {max_lines} per batch (--max-batch-lines)",
            param=param,
            code="too_many_lines",
        )
    return n
