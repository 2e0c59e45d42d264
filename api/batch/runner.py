"""Durable batch jobs (OpenAI's Batch API) run in an order chosen for the prefix cache.

A batch is an uploaded JSONL file (``/v1/files``, purpose ``batch``) of requests
``{"custom_id", "method": "POST", "url", "body"}`` for ``/v1/chat/completions`` or
``/v1/responses``. :class:`BatchManager` runs batches one after another:

1. **Validation, up front** (:func:`api.batch.lines.validate`, off the event loop):
   each body is checked by its endpoint's handler (:mod:`api.endpoints`); a malformed
   line goes to the error file, the others run.
2. **Cache-aware order** (``--batch-order cache``): lines sorted by their prompt
   (:func:`api.batch.lines.prompt_key`).
3. **Bounded, low-priority execution.** Each line runs through the same handler as its
   route (:meth:`api.endpoints.base.Endpoint.run_line`), submitted at background
   priority through the same :class:`~api.submit.EngineClient` as online requests: at
   most ``--batch-max-in-flight`` at once, and at most ``--batch-in-flight-with-online``
   while any online request runs, so interactive traffic keeps its latency. The runner
   waits for room on an awaited signal (a line finished, the engine client freed
   capacity, the batch was cancelled, or its window ends), never by polling.
4. **Durable** (:mod:`api.batch.job`): after a crash or restart an unfinished batch
   resumes; lines whose result is on disk are not run again (a torn last line is cut
   off and its request rerun), so every ``custom_id`` appears once in the output and
   error files. All file IO runs on one IO thread, in order, off the event loop. When
   the engine process dies under a line and a new one starts, the line runs again on
   it (it is not recorded as failed); lines wait while no engine process runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from api.batch.job import BatchJob, Outputs
from api.batch.lines import Line, check_lines, validate
from api.batch.store import FileStore
from api.commit import write_bytes_atomic
from api.endpoints import HANDLERS, Endpoint
from api.endpoints.base import Usage
from api.errors import APIError, error_body
from api.ids import BATCH
from api.state import ServerState
from api.submit import Submission
from mmserve.frontend.engine_client import EngineUnavailable
from mmserve.types import EngineRequest

log = logging.getLogger(__name__)

#: Seconds between fsyncs of the output files and saves of the state while running.
SYNC_INTERVAL = 1.0

T = TypeVar("T")


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
        self.jobs: dict[str, BatchJob] = {}
        self._queue: asyncio.Queue[str] | None = None
        self._worker: asyncio.Task | None = None
        self._io: ThreadPoolExecutor | None = None
        self._retired: ThreadPoolExecutor | None = None  # shut down by stop()
        self._wake: asyncio.Future[None] | None = None  # set by _poke
        self._sync_timer: asyncio.TimerHandle | None = None
        self._syncs: set[asyncio.Task] = set()  # held: the loop keeps only weak references
        self._units: set[asyncio.Task] = set()  # shielded cleanups; stop() waits for them
        self._io_error: Exception | None = None  # a failed sync or write of the running batch
        if self.dir.is_dir():
            for state in self.dir.glob("batch_*/state.json"):
                try:
                    job = BatchJob.load(state)
                except (OSError, ValueError):
                    log.warning("unreadable batch state %s", state)
                    continue
                self.jobs[job.id] = job

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker (on the event loop) and queue every unfinished batch."""
        if self._io is None:  # _on_io may have made it already
            self._io = _new_io()
        self._queue = asyncio.Queue()
        for job in sorted(self.jobs.values(), key=lambda j: (j.obj["created_at"], j.id)):
            if not job.ended:
                self._queue.put_nowait(job.id)
        self._worker = asyncio.ensure_future(self._work())

    async def stop(self) -> None:
        """Stop the worker; requests in flight are aborted and rerun after a restart."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        if self._units:  # a cleanup the cancel interrupted: its IO is still to come
            for r in await asyncio.gather(*self._units, return_exceptions=True):
                if isinstance(r, Exception):
                    log.error("batch cleanup failed at stop", exc_info=r)
        if self._io is not None:
            self._retired, self._io = self._io, None
            await asyncio.to_thread(self._retired.shutdown, wait=True)

    # ---- API ----------------------------------------------------------------------------
    async def create(self, input_file_id: str, endpoint: str, metadata: dict | None) -> dict:
        """A new batch over ``input_file_id`` (status ``validating``), queued to run.

        Raises:
            APIError: 400 for an unknown endpoint, a file that is not a batch input or
                has more lines than ``max_batch_lines`` or a malformed ``input_file_id``;
                404 for an unknown file.
        """
        if endpoint not in HANDLERS:
            raise APIError(
                400,
                f"endpoint: {endpoint!r} is not supported; use one of {sorted(HANDLERS)}",
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
        job = BatchJob.new(self.dir, endpoint, self.st.model_name, input_file_id, metadata)
        loop = asyncio.get_running_loop()

        def claim(raw: bytes) -> None:  # in the file's section: no delete passes between
            check_lines(raw, self.st.settings.max_batch_lines, "input_file_id")
            _on_loop(loop, self.jobs.__setitem__, job.id, job)

        await asyncio.to_thread(self.files.read, input_file_id, "input_file_id", 400, claim)
        try:
            await self._on_io(job.dir.mkdir, parents=True, exist_ok=True)
            await self._save(job)
        except Exception:
            # never saved nor queued: unclaim, or its input would stay "in use" (409) and
            # the batch listed as validating for ever
            self.jobs.pop(job.id, None)
            raise
        if self._queue is not None:
            self._queue.put_nowait(job.id)
        return job.obj

    def _job(self, batch_id: str) -> BatchJob:
        return BATCH.find(batch_id, "batch_id", self.jobs.get, 404)

    def get(self, batch_id: str) -> dict:
        """The batch object of ``batch_id``.

        Raises:
            APIError: 404 for an unknown or malformed id.
        """
        return self._job(batch_id).obj

    def list(self) -> list[dict]:
        """Batch objects, newest first."""
        objs = [j.obj for j in self.jobs.values()]
        return sorted(objs, key=lambda b: (b["created_at"], b["id"]), reverse=True)

    async def cancel(self, batch_id: str) -> dict:
        """Ask a batch to stop: ``cancelling`` now, ``cancelled`` once its in-flight
        requests are aborted (finished lines keep their results in the output files).

        A batch already ``finalizing`` (every line has run) is no longer cancellable: it
        is answered like an ended one and ends ``completed`` (see :class:`BatchJob`).

        Raises:
            APIError: 404 for an unknown id; 409 for a batch that is finalizing or ended.
        """
        job = self._job(batch_id)
        if job.ended or job.status == "finalizing":
            raise APIError(
                409,
                f"batch {batch_id!r} is already {job.status}; it cannot be cancelled",
                code="batch_not_cancellable",
            )
        if job.status != "cancelling":
            job.move("cancelling")
            self._poke()
            await self._save(job)
        return job.obj

    def uses_file(self, file_id: str) -> bool:
        """Whether an unfinished batch reads ``file_id``."""
        return any(j.obj["input_file_id"] == file_id and not j.ended for j in self.jobs.values())

    async def delete_file(self, file_id: str) -> None:
        """Delete a file unless an unfinished batch reads it, in the file's section
        (:meth:`FileStore.delete`; the batches are asked on the event loop, which owns
        them).

        Raises:
            APIError: 404 for an unknown file, 409 ``file_in_use``.
        """
        loop = asyncio.get_running_loop()
        busy = functools.partial(_on_loop, loop, self.uses_file)
        await asyncio.to_thread(self.files.delete, file_id, busy)

    # ---- file IO, on one thread in order ------------------------------------------------
    def _on_io(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """Run ``fn`` on the IO thread (after the IO already asked for)."""
        loop = asyncio.get_running_loop()
        call = functools.partial(fn, *args, **kwargs)
        if self._io is None and self._retired is None:  # not started yet: start() keeps it
            self._io = _new_io()
        if self._io is not None:
            return loop.run_in_executor(self._io, call)
        # after stop(): nothing would shut a kept thread down, so a one-off thread that
        # first lets the retired one drain (the IO stays in order)
        retired, one = self._retired, _new_io()

        def after_retired() -> T:
            if retired is not None:
                retired.shutdown(wait=True)
            return call()

        fut = loop.run_in_executor(one, after_retired)
        one.shutdown(wait=False)  # the thread ends once the call is done
        return fut

    async def _unit(self, coro: Awaitable[None]) -> None:
        """Await ``coro`` as one unit: a cancel of the caller (stop()) does not cut it
        short, and stop() waits for it before shutting the IO thread down."""
        task = asyncio.ensure_future(coro)
        self._units.add(task)
        task.add_done_callback(self._units.discard)
        await asyncio.shield(task)

    async def _save(self, job: BatchJob) -> None:
        """Write the job's ``state.json`` as of now; a cancelled caller does not stop it."""
        path, data = job.dir / "state.json", job.snapshot()
        await asyncio.shield(self._on_io(write_bytes_atomic, path, data))

    # ---- running ------------------------------------------------------------------------
    async def _work(self) -> None:
        assert self._queue is not None
        while True:
            job = self.jobs[await self._queue.get()]
            try:
                await self._run(job)
            except asyncio.CancelledError:
                raise
            except Exception:  # one broken batch must not stop the others
                log.exception("batch %s failed", job.id)
                if not job.ended:
                    job.fail("server_error", "internal error; see the server log")
                await self._save(job)

    async def _run(self, job: BatchJob) -> None:
        if job.ended:
            return
        if job.status == "cancelling":
            await self._unit(self._finalize(job, "cancelled"))
            return
        if job.status == "finalizing":
            await self._unit(self._finalize(job, "completed"))
            return
        handler = HANDLERS[job.obj["endpoint"]]
        try:
            raw = await self._on_io(self.files.read, job.obj["input_file_id"])
        except APIError:
            job.fail("input_file_missing", "the input file was deleted", "input_file_id")
            await self._save(job)
            return
        # validation is CPU work (up to 64 MiB, 50k lines): a worker thread of its own
        lines, invalid = await asyncio.to_thread(validate, raw, handler, self.st)
        fresh = job.status == "validating"
        out = await self._on_io(Outputs, job.dir, fresh)
        if fresh:
            await self._on_io(out.start, invalid)
            job.validated(invalid)
            await self._save(job)
        outs, errs = await self._on_io(out.records)
        job.recount(
            len(lines) + len(invalid),
            [handler.recorded_usage(r["response"]["body"]) for r in outs],
            len(errs),
        )
        # validation records (no response) name lines that never run, not answered ones
        done = {r["custom_id"] for r in outs + errs if r.get("response") is not None}
        todo = [ln for ln in lines if ln.custom_id not in done]
        if self.st.settings.batch_order == "cache":
            todo.sort(key=lambda ln: ln.key)
        self._io_error = None
        try:
            if todo and self._ready is not None:
                await self._ready()
            ended = await self._execute(job, handler, todo, out)
        finally:
            await self._unit(self._close(job, out))
        if self._io_error is not None:  # a sync or write failed: the batch fails (_work)
            raise self._io_error
        await self._unit(self._finalize(job, ended))

    async def _close(self, job: BatchJob, out: Outputs) -> None:
        """Let the syncs under way finish, close the files and save the state."""
        await self._stop_syncing()
        await self._on_io(out.close)
        await self._save(job)

    async def _execute(
        self, job: BatchJob, handler: Endpoint, todo: list[Line], out: Outputs
    ) -> str:
        """Run ``todo`` within the in-flight window; the status the batch ends with."""
        s, client = self.st.settings, self.st.client
        running: set[asyncio.Task] = set()

        def finished(task: asyncio.Task) -> None:
            running.discard(task)
            if not task.cancelled() and task.exception() is not None:
                self._failed(task.exception())
            self._poke()

        def room() -> bool:
            limit = s.batch_max_in_flight
            if client.online:
                limit = min(limit, s.batch_in_flight_with_online)
            return len(running) < limit

        ended = None
        try:
            for line in todo:
                ended = await self._wait(job, room)
                if ended is not None:
                    break
                task = asyncio.ensure_future(self._one(job, handler, line, out))
                running.add(task)
                task.add_done_callback(finished)
            if ended is None:
                ended = await self._wait(job, lambda: not running)
        finally:
            for t in running:
                t.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
        return ended or "completed"

    async def _wait(self, job: BatchJob, until: Callable[[], bool]) -> str | None:
        """Wait until ``until()`` holds (None) or the batch must end (the status it ends
        with, :meth:`BatchJob.interrupted`). Woken by :meth:`_poke` (a line finished,
        a cancel), by the engine client freeing capacity, or by the window's end."""
        loop = asyncio.get_running_loop()
        while True:
            if self._io_error is not None:
                raise self._io_error
            ended = job.interrupted()
            if ended is not None or until():
                return ended
            self._wake = wake = loop.create_future()
            freed = self.st.client.capacity_freed()
            left = max(0.0, job.obj["expires_at"] - time.time())
            try:
                await asyncio.wait({wake, freed}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                wake.cancel()
                freed.cancel()
                self._wake = None

    def _failed(self, e: BaseException | None) -> None:
        """Note the first IO failure of the running batch and wake the runner, which
        raises it (the batch fails with ``server_error``, as any internal error)."""
        if isinstance(e, Exception) and self._io_error is None:
            self._io_error = e
            self._poke()

    def _poke(self) -> None:
        """Wake the runner's :meth:`_wait`."""
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _one(self, job: BatchJob, handler: Endpoint, line: Line, out: Outputs) -> None:
        """Run one line through its endpoint's handler and append its record."""
        record_id = f"batch_req_{uuid.uuid4().hex}"
        usage: Usage | None = None
        while True:
            await self._engine_up()
            deaths = _engine_deaths(self.st)
            try:
                answer = await handler.run_line(self.st, line.body, self._submit)
                body, request_id, status = answer.body, answer.request_id, 200
                usage = answer.usage
            except APIError as e:
                body = e.body()
                request_id, status = f"req_{uuid.uuid4().hex}", e.status
            except Exception:  # recorded as failed, never silently lost
                log.exception("batch %s: line %s failed", job.id, line.custom_id)
                body = error_body("internal error; see the server log", "server_error", None, None)
                request_id, status = f"req_{uuid.uuid4().hex}", 500
            if status == 200 or _engine_deaths(self.st) == deaths:
                break
            # the engine process died under this line: run it again on the new one
            log.warning("batch %s: line %s runs again (engine restarted)", job.id, line.custom_id)
        record = {
            "id": record_id,
            "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None,
        }
        written = self._on_io(out.write, record, status == 200)

        def landed(f: asyncio.Future[None]) -> None:
            # counted once its record is written, even if this task is cancelled meanwhile
            if f.cancelled():
                return
            if f.exception() is not None:
                self._failed(f.exception())
            else:
                job.count(usage)

        written.add_done_callback(landed)
        await asyncio.shield(written)
        self._sync_soon(job, out)

    async def _engine_up(self) -> None:
        """Wait while the engine process is down and a new one is starting (no wait in
        one process); returns at once when none will start (the line then fails)."""
        wait_ready = getattr(self.st.aengine, "wait_ready", None)
        if wait_ready is None:
            return
        try:
            await wait_ready()
        except EngineUnavailable:
            pass

    async def _submit(self, reqs: Sequence[EngineRequest]) -> Submission:
        """Submit as background work, waiting while the engine's queue is full; a line's
        answer is not streamed, so only each request's result is collected (final-only).
        No engine to take it (``engine_unhealthy``) raises at once: :meth:`_one` runs the
        line again on the next engine process, or records it failed when none will start."""
        client = self.st.client
        while True:
            try:
                return client.submit(reqs, background=True, final_only=True)
            except APIError as e:
                if e.status != 503 or e.code == "engine_unhealthy":
                    raise
            await client.capacity_freed()

    def _sync_soon(self, job: BatchJob, out: Outputs) -> None:
        """fsync the files and save the state at most :data:`SYNC_INTERVAL` after the
        last sync (a timer, armed once per interval)."""
        if self._sync_timer is not None:
            return
        delay = max(0.0, SYNC_INTERVAL - (time.monotonic() - out.last_sync))

        def synced(task: asyncio.Task) -> None:
            self._syncs.discard(task)
            if not task.cancelled():
                self._failed(task.exception())

        def fire() -> None:
            self._sync_timer = None
            task = asyncio.ensure_future(self._sync(job, out))
            self._syncs.add(task)
            task.add_done_callback(synced)

        self._sync_timer = asyncio.get_running_loop().call_later(delay, fire)

    async def _sync(self, job: BatchJob, out: Outputs) -> None:
        await self._on_io(out.sync)
        await self._save(job)

    async def _stop_syncing(self) -> None:
        """Disarm the sync timer and let the syncs under way finish (before the close)."""
        if self._sync_timer is not None:
            self._sync_timer.cancel()
            self._sync_timer = None
        if self._syncs:  # their failures are noted by their done callbacks (_failed)
            await asyncio.gather(*map(asyncio.shield, self._syncs), return_exceptions=True)

    async def _finalize(self, job: BatchJob, status: str) -> None:
        """Publish the output and error files and end the batch with ``status`` (a
        batch cancelled before it reached ``finalizing`` ends ``cancelled``)."""
        if status == "completed" and job.status == "cancelling":  # the cancel was accepted
            status = "cancelled"
        if status == "completed" and job.status != "finalizing":
            job.move("finalizing")
            await self._save(job)
        for kind, fid in await self._on_io(self._publish, job):
            job.obj[f"{kind}_file_id"] = fid
        job.move(status)
        await self._save(job)

    def _publish(self, job: BatchJob) -> list[tuple[str, str]]:
        """Move the non-empty output and error files into the file store (blocking IO);
        ``(kind, file id)`` of each published one."""
        published = []
        for kind, name in (("output", "output.jsonl"), ("error", "errors.jsonl")):
            fid = job.reserved[kind]
            if self.files.publish(fid, job.dir / name, f"{job.id}_{kind}.jsonl"):
                published.append((kind, fid))
        return published


def _engine_deaths(st: ServerState) -> int:
    """Engine processes that died so far (0 for an engine in this process)."""
    return getattr(st.aengine, "deaths", 0)


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on ``loop`` from a worker thread and wait for it (state the
    loop owns is touched only there)."""

    async def call() -> T:
        return fn(*args)

    return asyncio.run_coroutine_threadsafe(call(), loop).result()


def _new_io() -> ThreadPoolExecutor:
    """The one thread all batch file IO runs on, in order."""
    return ThreadPoolExecutor(1, thread_name_prefix="mmserve-batch-io")
