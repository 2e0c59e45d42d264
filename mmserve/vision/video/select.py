"""Which frames of a video a request takes: ``num_frames``, ``fps`` or ``timestamps``
within the frame and token budgets (:func:`sample_frame_indices`).

Frame selection is a pure function of the video's frame times, duration, the request
and its caps: no decoding here. The frame shown at time ``t`` is the last one whose time
is ``<= t``. Also the error and the limits every video module uses (:class:`VideoError`,
:class:`VideoLimits`).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

#: Frames sampled when a request names neither ``num_frames``, ``fps`` nor ``timestamps``.
DEFAULT_NUM_FRAMES = 8
_EPS = 1e-6


class VideoError(ValueError):
    """A video or frame selection that cannot be accepted; the message says why (HTTP 400).

    Attributes:
        field: the request field at fault, one the client set (``"timestamps"``,
            ``"fps"``, ``"num_frames"``, ``"max_frames"``, ``"max_video_tokens"``; or
            ``"num_frames"`` for the default count), or None when the video itself is at
            fault.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class VideoLimits:
    """Bounds checked on every video.

    Attributes:
        max_bytes: largest encoded upload (bytes).
        max_frames: most frames sampled for one request (``fps`` and the default are
            thinned to it, an exact count over it is refused: :func:`sample_frame_indices`).
        max_side: largest frame width or height (pixels).
        max_pixels: largest width*height of a frame (pixels).
        max_video_frames: most frames a video may hold (the probe reads every packet
            header, so this bounds its work: 100000 is 55 minutes at 30 fps).
        max_tokens: most pseudo-tokens the sampled frames of one video may take in a
            prompt (the server's ``--max-video-tokens``; None: no token budget). A budget:
            ``fps`` and the default sampling are thinned to fit it.
    """

    max_bytes: int = 64 * 1024 * 1024
    max_frames: int = 64
    max_side: int = 3840
    max_pixels: int = 3840 * 2160
    max_video_frames: int = 100_000
    max_tokens: int | None = None


#: The selection fields that say which frames are taken; at most one per request.
SELECTORS = ("num_frames", "fps", "timestamps")


@dataclass(frozen=True)
class FrameSelection:
    """Which frames a request wants: at most one of ``num_frames``, ``fps``,
    ``timestamps`` (none: :data:`DEFAULT_NUM_FRAMES` uniform frames), and the caps.

    A field is set when it is not None (the API maps the client's fields one to one), so
    errors can name the field the client set (:meth:`count_field`).

    Attributes:
        num_frames: frames spread uniformly over the frame list (each the centre of its
            segment; by index, so a variable frame rate does not bunch them). Exact: never
            lowered to fit a cap.
        fps: frames per second of video: the frames shown at ``0, 1/fps, 2/fps, ...``
            seconds, before the end, each once. Thinned to fit a cap.
        timestamps: explicit times (seconds, ``0 <= t < duration``); each picks the frame
            shown at that time. Exact.
        max_frames: the most frames to take (a cap: ``fps`` and the default are thinned
            to it; ``num_frames`` or ``timestamps`` over it is a contradiction).
        max_video_tokens: the most pseudo-tokens this video's frames may take (a cap like
            ``max_frames``, in tokens; the server's ``--max-video-tokens`` bounds it too).
    """

    num_frames: int | None = None
    fps: float | None = None
    timestamps: tuple[float, ...] | None = None
    max_frames: int | None = None
    max_video_tokens: int | None = None

    def selector(self) -> str | None:
        """The selection field set (``num_frames``, ``fps``, ``timestamps``), or None."""
        return next((n for n in SELECTORS if getattr(self, n) is not None), None)

    def count_field(self, chosen: int) -> str:
        """The request field that decided how many frames were taken (``chosen``), for an
        error about their number: ``timestamps`` or ``num_frames`` when set; else
        ``max_frames`` when set and ``chosen`` reached it (or nothing else was set); else
        ``fps`` when set; else ``num_frames`` (the default count, which the client may set).
        """
        sel = self.selector()
        if sel in ("timestamps", "num_frames"):
            return sel
        if self.max_frames is not None and (sel is None or chosen >= self.max_frames):
            return "max_frames"
        return sel or "num_frames"


@dataclass(frozen=True)
class FrameCost:
    """Pseudo-tokens the sampled frames of one video take in its prompt.

    Attributes:
        per_frame: tokens per frame (LLaVA-OneVision's video path: 196; a family without
            a video path: the frame's count as an image of its prompt).
        per_video: tokens once per video (OneVision: the video newline; else 0).
    """

    per_frame: int
    per_video: int = 0

    def tokens(self, frames: int) -> int:
        """Tokens ``frames`` frames take (0 for none)."""
        return frames * self.per_frame + self.per_video if frames else 0

    def fit(self, budget: int) -> int:
        """The most frames whose tokens are ``<= budget``."""
        return max(0, (budget - self.per_video) // self.per_frame)


def sample_frame_indices(
    num_frames: int,
    fps: float,
    duration: float,
    selection: FrameSelection,
    max_frames: int,
    frame_times: Sequence[float] | None = None,
    cost: FrameCost | None = None,
    max_tokens: int | None = None,
) -> list[int]:
    """Frame indices for ``selection`` (ascending for ``num_frames``/``fps``/the default; as
    asked for ``timestamps``).

    The frame for a time ``t`` is the one a player shows then: the last frame whose
    time is ``<= t`` (the first frame for a ``t`` before it).

    How the fields combine (one rule): at most one of ``num_frames``, ``fps``,
    ``timestamps`` picks the frames (none: :data:`DEFAULT_NUM_FRAMES` uniform). The cap is
    the smallest of the server's ``max_frames``, the request's ``max_frames`` and the
    frames that fit the token budget (the smaller of the request's ``max_video_tokens``
    and ``max_tokens``, priced by ``cost``). ``fps`` and the default are lowered to the
    cap: ``fps`` whose frames would exceed it takes the cap's count of frames spread
    evenly over the clip, as ``num_frames`` would. ``num_frames`` and ``timestamps`` are
    exact: over a cap they are refused, as is a request's ``max_frames`` or
    ``max_video_tokens`` over the server's.

    Args:
        num_frames: frames in the video.
        fps: its average frame rate (used only without ``frame_times``).
        duration: its length (seconds).
        selection: what the request asked for.
        max_frames: most frames allowed (the server's ``--max-video-frames``).
        frame_times: each frame's presentation time (seconds); default ``i / fps``.
        cost: tokens per frame and per video in the prompt (None: no token budget).
        max_tokens: the server's token budget per video (None: none).

    Returns:
        Indices into the video. ``num_frames`` beyond the video's frames gives every frame
        once (a 3-frame video asked for 8 gives 3); ``fps`` drops repeats of a frame.
        With ``cost``, ``cost.tokens(len(result))`` is within the budget.

    Raises:
        VideoError: no frames; a bad, contradictory or over-limit selection, whose
            ``field`` is the field the client set (:meth:`FrameSelection.count_field`) and
            whose message names the limit crossed; a timestamp that is negative, not a
            number, or at or past the end (the message gives the duration).
    """
    if num_frames < 1:
        raise VideoError("video has no frames")
    sel = selection
    given = [n for n in SELECTORS if getattr(sel, n) is not None]
    if len(given) > 1:
        raise VideoError(
            f"give one of num_frames, fps or timestamps, not {' and '.join(given)}", given[-1]
        )
    if sel.max_frames is not None:
        if sel.max_frames < 1:
            raise VideoError(f"max_frames must be >= 1, got {sel.max_frames}", "max_frames")
        if sel.max_frames > max_frames:
            raise VideoError(
                f"max_frames={sel.max_frames} is over the limit of {max_frames} frames per "
                "request (the server's --max-video-frames)",
                "max_frames",
            )
    asked = sel.max_video_tokens
    if asked is not None and asked < 1:
        raise VideoError(f"max_video_tokens must be >= 1, got {asked}", "max_video_tokens")
    if asked is not None and max_tokens is not None and asked > max_tokens:
        raise VideoError(
            f"max_video_tokens={asked} is over the limit of {max_tokens} video tokens (the "
            "server's --max-video-tokens)",
            "max_video_tokens",
        )
    budget = _token_budget(asked, max_tokens)
    fit: int | None = None
    if budget is not None and cost is not None:
        tokens, named, field = budget
        fit = cost.fit(tokens)
        if fit < 1:
            raise VideoError(
                f"one frame of this video takes {cost.tokens(1)} tokens; {named} leaves "
                "room for none",
                field or sel.count_field(1),
            )
    caps = [c for c in (sel.max_frames, fit) if c is not None]

    def exact(asked: int, taken: int, what: str, field: str) -> None:
        """Refuse an exact count over a limit: ``asked`` frames named, ``taken`` taken."""
        if asked > max_frames:
            raise VideoError(
                f"{what} selects {asked} frames; the limit is {max_frames} frames per "
                "request (the server's --max-video-frames)",
                field,
            )
        if sel.max_frames is not None and asked > sel.max_frames:
            raise VideoError(
                f"{what} selects {asked} frames, more than max_frames={sel.max_frames}; "
                "give one or the other",
                field,
            )
        if fit is not None and cost is not None and budget is not None and taken > fit:
            raise VideoError(
                f"{what} selects {taken} frames, {cost.tokens(taken)} video tokens at "
                f"{cost.per_frame} per frame; {budget[1]} fits {fit} frame{'s' * (fit != 1)}",
                field,
            )

    def uniform(n: int) -> list[int]:
        if n >= num_frames:
            return list(range(num_frames))
        return [min(num_frames - 1, int((k + 0.5) * num_frames / n)) for k in range(n)]

    times = list(frame_times) if frame_times is not None else [i / fps for i in range(num_frames)]

    def at(t: float) -> int:
        return min(num_frames - 1, max(0, bisect_right(times, t + _EPS) - 1))

    if sel.timestamps is not None:
        ts = list(sel.timestamps)
        if not ts:
            raise VideoError("timestamps is empty", "timestamps")
        exact(len(ts), len(ts), f"timestamps ({len(ts)} times)", "timestamps")
        span = f"from 0 up to but not including {duration:g} s, the video's duration"
        for t in ts:
            if not math.isfinite(t) or t < 0:
                raise VideoError(
                    f"timestamp {t} is not a time in the video (give times {span})", "timestamps"
                )
            # t = 0 stays valid for a video whose duration is unknown (0)
            if t > duration - _EPS and t > _EPS:
                raise VideoError(
                    f"timestamp {t:g} s is at or beyond the video's duration ({duration:g} s); "
                    f"give times {span}",
                    "timestamps",
                )
        return [at(t) for t in ts]
    if sel.fps is not None:
        rate = sel.fps
        if not math.isfinite(rate) or rate <= 0:
            raise VideoError(f"fps must be > 0, got {rate}", "fps")
        samples = duration * rate
        # sample times k / rate before the end: 0 <= k / rate < duration
        count = max(1, math.ceil(samples - _EPS)) if math.isfinite(samples) else math.inf
        cap = min([max_frames, *caps])
        if count > cap:  # thinned: the cap's count of frames, evenly over the clip
            return uniform(cap)
        out: list[int] = []
        for k in range(int(count)):
            i = at(k / rate)
            if not out or out[-1] != i:
                out.append(i)
        return out
    if sel.num_frames is None:  # the default, lowered to every limit
        return uniform(min(DEFAULT_NUM_FRAMES, max_frames, *caps))
    n = sel.num_frames
    if n < 1:
        raise VideoError(f"num_frames must be >= 1, got {n}", "num_frames")
    exact(n, min(n, num_frames), f"num_frames={n}", "num_frames")
    return uniform(n)


def _token_budget(asked: int | None, server: int | None) -> tuple[int, str, str | None] | None:
    """The video token budget: ``(tokens, its name in messages, the request field or
    None)``: the request's ``max_video_tokens`` (no more than the server's), else the
    server's, else None."""
    if asked is not None:
        return asked, f"max_video_tokens={asked}", "max_video_tokens"
    if server is not None:
        return server, f"the server's limit of {server} video tokens (--max-video-tokens)", None
    return None
