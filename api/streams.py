"""Live video streams (``/v1/streams``): each stream's frames, window and held prefix,
and the registry that bounds, owns and expires them.

A stream's prompt is a ``/qa`` clip over its window's frames (the family says how:
:meth:`~mmserve.model.families.base.ModelFamily.stream_layout`), so an answer through a
stream is the answer of that clip. As frames arrive the prefix up to the last frame's
run is prefilled at background priority as a held request
(:attr:`~mmserve.types.EngineRequest.hold`, id = the stream's id): the engine keeps it
locked in the radix cache until the stream ends, and a question prefills only what
follows its last frame. One prefill runs per stream at a time; frames that arrive
meanwhile are taken by the next one (it covers every frame so far), so nothing queues.

The window rule (docs/video.md): a stream holds at most ``max_frames`` frames. When a
frame arrives at a full window the stream rolls: its new segment starts from the last
``W = max_frames - roll_frames`` frames plus the new one, and prefills them as one new
prefix (their features come from the embedding cache: no tower run); the old prefix is
released to the tree as evictable once the new one is locked. A roll happens once every
``roll_frames`` frames, so a frame costs one frame's prefill plus ``W / roll_frames``
frames' amortized.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field

from fastapi.concurrency import run_in_threadpool

from api.errors import APIError
from api.routes_videos import clip_prompt
from api.state import ServerState
from api.submit import Submission
from api.tenants import current_tenant, owned_by
from mmserve import cancel
from mmserve.model.families.base import DETAILS, FRAME_MODE
from mmserve.types import BACKGROUND, EngineRequest, SamplingParams
from mmserve.vision.inputs import Frame, ImageInput

log = logging.getLogger(__name__)

#: Tokens kept for the question and the answer when a window is checked against the
#: context (``api.routes_streams._most_frames``).
ASK_ROOM_TOKENS = 64
#: Default ``max_frames`` of a stream (capped by the server's limits).
DEFAULT_MAX_FRAMES = 32
#: Share of the KV pool that every live stream's held prefix may lock together. Held pages
#: are not evictable: without a bound a few streams (or one long window) could lock the
#: pool, and every other request would wait for pages that never free. A prefix that would
#: pass it is not held (asks still answer, prefilling the window themselves).
HELD_KV_SHARE = 0.5
#: ``GET``'s ``cached.error`` once the engine process that held a stream's prefix died.
LOST_HOLD = (
    "not held: the engine process restarted and lost the held prefix; the next frame "
    "prefills the window again (questions still answer meanwhile)"
)
#: Largest frame timestamp, in seconds (about 116 days): a timestamp is printed into the
#: frame's ``Frame at 1.5s:`` label, so an unbounded one (``1e99``) would make a label of
#: any length; the frame-token bound counts labels this long.
MAX_TIMESTAMP_S = 1e7


@dataclass
class StreamFrame:
    """One frame a stream kept.

    Attributes:
        number: how many frames the stream kept before it (0-based, across rolls).
        timestamp: its time (seconds, increasing along the stream).
        image: hashed, with its tower input prepared in the stream's frame mode.
    """

    number: int
    timestamp: float
    image: ImageInput


@dataclass
class Held:
    """What the engine holds prefilled for a stream: its first ``frames`` frames of
    segment ``segment`` (``tokens`` prompt tokens in whole pages), in the engine process
    that came after ``engine_life`` deaths (:func:`engine_life`)."""

    segment: int
    frames: int
    tokens: int
    engine_life: int = 0


@dataclass
class Stream:
    """One live video stream (see the module docstring).

    Attributes:
        id: ``stream-`` + 32 hex digits; also its hold id in the engine.
        owner: the tenant that made it (another tenant gets 404).
        salt: the effective cache salt of its prompts (tenant and ``cache_salt``).
        layout: "video" or "images" (:meth:`ModelFamily.stream_layout`).
        mode: the mode its frames are prepared in.
        frames: the window: the frames of the current segment, oldest first.
        segment: rolls so far.
        received, thinned: frames posted, and of those dropped by ``fps``.
        last_timestamp: the newest frame's timestamp (kept or thinned), None before one.
        held: what the engine holds prefilled (None: nothing yet).
        prefills: held prefills run; prefill_error: why the last one failed, if it did.
        pixel_bytes: the window's frame pixels reserved (:meth:`StreamRegistry.reserve_pixels`).
        asks: the submissions of asks still answering (cancelled when the stream ends).
    """

    id: str
    owner: str
    salt: str
    layout: str
    mode: str
    fps: float | None
    max_frames: int
    roll_frames: int
    detail: str
    system: str | None
    created: float = field(default_factory=time.time)
    started: float = field(default_factory=time.monotonic)
    used: float = field(default_factory=time.monotonic)
    frames: list[StreamFrame] = field(default_factory=list)
    segment: int = 0
    kept: int = 0
    received: int = 0
    thinned: int = 0
    last_timestamp: float | None = None
    last_kept: float | None = None
    held: Held | None = None
    prefills: int = 0
    prefill_error: str | None = None
    sockets: int = 0
    pixel_bytes: int = 0
    asks: set[Submission] = field(default_factory=set)
    closed: bool = False
    _dirty: bool = False
    _task: asyncio.Task | None = None

    def touch(self) -> None:
        """Count now as activity (frames, a question, a WebSocket message)."""
        self.used = time.monotonic()

    def idle_for(self) -> float:
        """Seconds since the last activity (0 while a WebSocket is open or an ask is
        answering: an ask is activity until its answer is out)."""
        return 0.0 if self.sockets or self.asks else time.monotonic() - self.used

    def default_timestamp(self) -> float:
        """A frame's timestamp when the client gives none: seconds since the stream was
        made, after the newest frame's."""
        now = time.monotonic() - self.started
        last = self.last_timestamp
        return now if last is None or now > last else last + 1e-3

    def add(self, timestamp: float, image: ImageInput) -> bool:
        """Take one frame (its timestamp already checked to increase): thinned when it
        comes sooner than ``1 / fps`` after the last kept frame, else kept, the window
        rolling first when full (module docstring).

        Returns:
            Whether the frame was kept.
        """
        self.received += 1
        self.last_timestamp = timestamp
        if self.fps and self.last_kept is not None and timestamp < self.last_kept + 1 / self.fps:
            self.thinned += 1
            return False
        if len(self.frames) >= self.max_frames:
            keep = self.max_frames - self.roll_frames
            self.frames = self.frames[len(self.frames) - keep :] if keep else []
            self.segment += 1
        self.frames.append(StreamFrame(self.kept, timestamp, image))
        self.kept += 1
        self.last_kept = timestamp
        return True

    def window(self, frames: int | None = None, seconds: float | None = None) -> list[StreamFrame]:
        """The window's frames an ask covers: all (default), the last ``frames``, or those
        of the last ``seconds`` before the newest frame."""
        out = self.frames
        if frames is not None:
            out = out[-frames:] if frames else []
        if seconds is not None and out:
            end = out[-1].timestamp
            out = [f for f in out if f.timestamp >= end - seconds]
        return list(out)

    def info(self) -> dict:
        """The stream as ``GET /v1/streams/{id}`` answers."""
        win = self.frames
        held = self.held if self.held is not None and self.held.segment == self.segment else None
        return {
            "id": self.id,
            "object": "stream",
            "created_at": int(self.created),
            "fps": self.fps,
            "max_frames": self.max_frames,
            "roll_frames": self.roll_frames,
            "detail": self.detail,
            "system": self.system,
            "layout": self.layout,
            "frames": len(win),
            "frames_received": self.received,
            "frames_thinned": self.thinned,
            "thinned": self.thinned,
            "frames_held": len(win),
            "segments": self.segment + 1,
            "pixel_bytes_reserved": self.pixel_bytes,
            "window": {
                "frames": len(win),
                "start": win[0].timestamp if win else None,
                "end": win[-1].timestamp if win else None,
                "seconds": win[-1].timestamp - win[0].timestamp if win else 0.0,
                "first_frame": win[0].number if win else None,
            },
            "tokens": held.tokens if held else 0,
            "cached": {
                "frames": held.frames if held else 0,
                "tokens": held.tokens if held else 0,
                "pending": self._task is not None and not self._task.done(),
                "prefills": self.prefills,
                "error": self.prefill_error,
            },
            "idle_seconds": round(self.idle_for(), 3),
        }

    # ---- prompts ------------------------------------------------------------------
    def clip(self, frames: list[StreamFrame]) -> list[Frame]:
        """``frames`` as a ``/qa`` clip's frames."""
        return [Frame(f.number, f.timestamp, f.image) for f in frames]

    def details(self, st: ServerState, n: int) -> list[str]:
        """Each frame's ``detail`` in a prompt of ``n`` frames as images, chosen so that
        every frame takes :attr:`mode` whatever ``n`` (empty on the video layout)."""
        if self.layout == "video":
            return []
        family = st.engine.model.family
        for d in (self.detail, *DETAILS):
            if family.detail_mode(d, n) == self.mode:
                return [d] * n
        return [self.detail] * n

    async def prefix_request(self, st: ServerState, frames: list[StreamFrame]) -> EngineRequest:
        """The held request of the prompt over ``frames`` up to the last frame's run
        (background priority, one greedy token).

        Raises:
            RequestError, PromptError and whatever the processor raises for the prompt.
        """
        clip = self.clip(frames)
        system = [{"role": "system", "content": self.system}] if self.system else []
        msgs, images, videos = clip_prompt(st, clip, system, "")
        processor = st.engine.processor

        def build() -> EngineRequest:
            return processor.make_request(
                messages=msgs,
                images=images,
                videos=videos,
                params=SamplingParams(max_tokens=1, temperature=0.0),
                details=self.details(st, len(frames)),
                cache_salt=self.salt,
            )

        full = await run_in_threadpool(build)
        end = st.engine.model.family.stream_held_end(full.spans)
        return dataclasses.replace(
            full,
            input_ids=full.input_ids[:end],
            spans=tuple(s for s in full.spans if s.end <= end),
            priority=BACKGROUND,
            hold=self.id,
            text_context=(),
        )

    # ---- the held prefix ------------------------------------------------------------
    def prefill(self, st: ServerState) -> None:
        """Have the engine hold the prefix of the frames so far: starts the stream's one
        prefill task, or marks the frames for the next round of the one running."""
        self._dirty = True
        if self.closed or (self._task is not None and not self._task.done()):
            return
        with cancel.using(None):  # the stream's work, not the posting request's
            self._task = asyncio.ensure_future(self._prefill_loop(st))

    async def _prefill_loop(self, st: ServerState) -> None:
        page = st.engine.config.page_size
        while self._dirty and not self.closed:
            self._dirty = False
            frames, segment = list(self.frames), self.segment
            if not frames:
                continue
            self.prefills += 1
            if self.prefill_error == LOST_HOLD:  # this round prefills the window again
                self.prefill_error = None
            try:
                req = await self.prefix_request(st, frames)
                budget = int(HELD_KV_SHARE * st.engine.processor.kv_capacity_tokens)
                others = held_elsewhere(st, self)
                over = others + req.prompt_len > budget
                if over or (self.held is not None and self.held.segment != segment):
                    # a roll releases the old segment before the new one is prefilled (never
                    # two windows locked at once); past the budget nothing stays held
                    self.held = None
                    await st.aengine.control("release_hold", self.id)
                if over:
                    self.prefill_error = (
                        f"not held: this window's {req.prompt_len} tokens and the other "
                        f"streams' {others} held tokens pass the {budget} tokens of KV that "
                        f"live streams may lock ({HELD_KV_SHARE:g} of the pool); questions "
                        "still answer, prefilling the window themselves"
                    )
                    continue
                res = await st.aengine.generate(req)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - reported in GET; asks still work
                self.prefill_error = f"{type(e).__name__}: {e}"
                log.warning("stream %s: prefill failed: %s", self.id, self.prefill_error)
                continue
            if res.finish_reason in ("stop", "length"):
                tokens = res.prompt_tokens // page * page
                self.held = Held(segment, len(frames), tokens, engine_life(st))
                self.prefill_error = None
            else:
                self.prefill_error = res.error or f"prefill ended: {res.finish_reason}"

    def forget_lost_hold(self, life: int) -> None:
        """Drop what the stream thinks is held when the engine process that held it died
        (``life``: :func:`engine_life` now): a new engine holds nothing, and the next
        frame prefills the window again."""
        if self.held is not None and self.held.engine_life != life:
            self.held = None
            self.prefill_error = LOST_HOLD

    async def close(self, st: ServerState) -> None:
        """End the stream: its prefill aborted (awaited, so that no held request is left
        to take the hold after), then the hold released (its pages evictable)."""
        if self.closed:
            return
        self.closed = True
        for ask in list(self.asks):  # asks still answering end with the stream
            ask.cancel()
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.frames = []
        self.held = None
        with contextlib.suppress(Exception):  # no engine: nothing is held any more
            await st.aengine.control("release_hold", self.id)


class StreamRegistry:
    """The server's live streams: made within ``--max-streams``, found only by their
    tenant, deleted on request, at idle expiry (``--stream-idle-seconds``) and at shutdown.

    Args:
        max_streams: most streams open at once (all tenants).
        idle_seconds: a stream idle this long is deleted.
    """

    def __init__(self, max_streams: int, idle_seconds: float) -> None:
        self.max_streams = max_streams
        self.idle_seconds = idle_seconds
        self._streams: dict[str, Stream] = {}
        #: the smallest frame's pixel bytes by frame mode (``smallest_frame_bytes``)
        self.frame_floor: dict[str, int] = {}
        self._reaper: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._streams)

    def streams(self) -> list[Stream]:
        """Every open stream (all tenants; for server-wide bounds, never for answers)."""
        return list(self._streams.values())

    def add(self, st: ServerState, **options) -> Stream:
        """A new stream of the current tenant with ``options`` (:class:`Stream` fields).

        Raises:
            APIError: 429 ``too_many_streams`` when ``max_streams`` are open.
        """
        if len(self._streams) >= self.max_streams:
            raise APIError(
                429,
                f"too many live streams: {len(self._streams)} are open and the server allows "
                f"{self.max_streams} (--max-streams); delete one (DELETE /v1/streams/{{id}}) "
                f"or wait for an idle one to expire (--stream-idle-seconds "
                f"{self.idle_seconds:g})",
                "rate_limit_error",
                code="too_many_streams",
            )
        stream = Stream(id=f"stream-{uuid.uuid4().hex}", owner=current_tenant(), **options)
        self._streams[stream.id] = stream
        if self._reaper is None or self._reaper.done():
            with cancel.using(None):
                self._reaper = asyncio.ensure_future(self._reap(st))
        return stream

    def reserve_pixels(self, stream: Stream, frame_bytes: int, budget: int) -> None:
        """Reserve room for ``stream``'s whole window of prepared frame pixels,
        ``max_frames * frame_bytes`` (a window keeps every frame's tower input, for the
        prefill after a roll), out of ``budget`` bytes for all streams
        (``--max-stream-pixel-bytes``); done at its first frame and again if a frame is
        larger (the images layout's tiles follow the frame's size).

        Raises:
            APIError: 400 naming ``max_frames`` when the window alone needs more than the
                budget; 429 ``stream_pixels_full`` when other streams hold the rest.
        """
        need = stream.max_frames * frame_bytes
        if need <= stream.pixel_bytes:
            return
        check_window(stream.max_frames, frame_bytes, budget)
        others = sum(s.pixel_bytes for s in self._streams.values() if s is not stream)
        if others + need > budget:
            raise APIError(
                429,
                f"the live streams' frames are full: this stream's window needs {need} bytes "
                f"of pixels and other streams hold {others} of {budget} "
                "(--max-stream-pixel-bytes); delete a stream or wait for an idle one to expire",
                "rate_limit_error",
                code="stream_pixels_full",
            )
        stream.pixel_bytes = need

    async def get(self, st: ServerState, ident: str) -> Stream | None:
        """The current tenant's stream ``ident`` (None: unknown, another tenant's, deleted
        or expired; an expired one is deleted here)."""
        stream = self._streams.get(ident)
        if stream is None or not owned_by(stream.owner):
            return None
        stream.forget_lost_hold(engine_life(st))
        if stream.idle_for() > self.idle_seconds:
            await self.delete(st, stream)
            return None
        return stream

    async def delete(self, st: ServerState, stream: Stream) -> bool:
        """Remove and close ``stream``; False if it was already gone."""
        if self._streams.pop(stream.id, None) is None:
            return False
        await stream.close(st)
        return True

    async def expire(self, st: ServerState) -> int:
        """Delete every stream idle longer than ``idle_seconds``; returns how many."""
        old = [s for s in self._streams.values() if s.idle_for() > self.idle_seconds]
        for stream in old:
            await self.delete(st, stream)
        if old:
            log.info("%d idle streams expired", len(old))
        return len(old)

    async def _reap(self, st: ServerState) -> None:
        pause = min(max(self.idle_seconds / 4, 0.05), 5.0)
        while self._streams:
            await asyncio.sleep(pause)
            try:
                await self.expire(st)
            except Exception:
                log.exception("stream expiry failed")

    async def close(self, st: ServerState) -> None:
        """Delete every stream and stop the expiry task (the app's shutdown)."""
        for stream in list(self._streams.values()):
            await self.delete(st, stream)
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)


def held_elsewhere(st: ServerState, stream: Stream) -> int:
    """Prompt tokens the other live streams hold now (their current segments)."""
    reg = getattr(st, "streams", None)
    if reg is None:
        return 0
    life = engine_life(st)
    for s in reg.streams():
        s.forget_lost_hold(life)
    return sum(s.held.tokens for s in reg.streams() if s is not stream and s.held is not None)


def check_window(max_frames: int, frame_bytes: int, budget: int) -> None:
    """Refuse a window of ``max_frames`` frames of ``frame_bytes`` pixel bytes each that
    alone needs more than ``budget`` (``--max-stream-pixel-bytes``).

    Raises:
        APIError: 400 ``stream_window_too_large`` naming ``max_frames``.
    """
    need = max_frames * frame_bytes
    if need > budget:
        raise APIError(
            400,
            f"max_frames: a window of {max_frames} frames of {frame_bytes} bytes of pixels "
            f"each needs {need} bytes; the server keeps at most {budget} for all streams "
            "(--max-stream-pixel-bytes): make the stream with fewer max_frames",
            param="max_frames",
            code="stream_window_too_large",
        )


def engine_life(st: ServerState) -> int:
    """How many times the server's engine process died (restarted since): a prefix held
    in an earlier life is gone. Always 0 for an engine in the API process."""
    return int(getattr(st.aengine, "deaths", 0))


def frame_mode(st: ServerState, layout: str, detail: str) -> str:
    """The mode a stream's frames are prepared in: the video path's frame mode, else the
    mode of an image sent with ``detail`` among several (as a ``/qa`` clip's frames)."""
    if layout == "video":
        return FRAME_MODE
    return st.engine.model.family.detail_mode(detail, 2)
