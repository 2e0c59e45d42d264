"""How a decoded frame is displayed: FFmpeg's display matrix (rotation and mirroring,
also what FFmpeg makes of a JPEG or PNG frame's EXIF orientation) read from PyAV frames
and applied as FFmpeg's command line does (:func:`orient`). A frame without one is shown
as the first decoded frame was (the decoder keeps the probe frame's matrix).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np


def orient(frame: np.ndarray, matrix: Sequence[int] | None) -> np.ndarray:
    """A decoded frame as displayed: the display matrix's rotation and mirroring applied.

    FFmpeg's display matrix (``AV_FRAME_DATA_DISPLAYMATRIX``, libavutil/display.h) maps
    a stored pixel ``(x, y)`` (y down) to ``(a*x + c*y, b*x + d*y)`` up to a shift, with
    ``a, b, c, d = m[0], m[1], m[3], m[4]`` in 16.16 fixed point. Quarter turns and
    mirrors are applied exactly, as the ``ffmpeg`` command line's autorotation does
    (``transpose``, ``hflip``, ``vflip``); other angles are rounded to the nearest quarter
    turn (the command line rotates by the exact angle and fills the corners).

    Args:
        frame: ``(H, W, C)`` array as stored.
        matrix: the 9 int32 entries, or None for none.

    Returns:
        ``(H', W', C)`` C-contiguous array; ``H', W' = W, H`` for a quarter turn.
    """
    if matrix is None:
        return frame
    a, b, _, c, d = matrix[:5]
    if a == b == c == d == 0:  # a degenerate matrix: display as stored
        return frame
    out = frame
    if abs(a) >= abs(b):  # x' = a*x, y' = d*y
        if a < 0:
            out = out[:, ::-1]
        if d < 0:
            out = out[::-1]
    else:  # x' = c*y, y' = b*x: rows become columns
        out = out.transpose(1, 0, 2)
        if c < 0:
            out = out[:, ::-1]
        if b < 0:
            out = out[::-1]
    return np.ascontiguousarray(out)


def display_matrix(frame: object) -> tuple[int, ...] | None:
    """The display matrix side data of a decoded PyAV frame (9 int32), or None.

    A frame may also carry side data that PyAV does not name (FFmpeg 8's EXIF, which
    its MJPEG, PNG, TIFF and WebP decoders attach; the EXIF orientation itself becomes
    the display matrix): :func:`_name_side_data_types` gives such types placeholder
    names, since PyAV refuses to list a frame's side data otherwise. If listing still
    fails, the rotation PyAV reads from the matrix in C (``frame.rotation``) is used,
    without mirroring.
    """
    import av.sidedata.sidedata as sd

    _name_side_data_types()
    try:
        entries = list(frame.side_data)  # type: ignore[attr-defined]
    except ValueError:  # a side data type PyAV cannot name
        return rotation_matrix(getattr(frame, "rotation", 0) or 0)
    for entry in entries:
        if entry.type == sd.Type.DISPLAYMATRIX:
            raw = bytes(entry)
            if len(raw) >= 36:
                return struct.unpack("=9i", raw[:36])
    return None


def rotation_matrix(degrees: float) -> tuple[int, ...] | None:
    """The display matrix of a rotation by ``degrees`` counter-clockwise (the angle
    ``av_display_rotation_get`` reads, PyAV's ``frame.rotation``), as libavutil's
    ``av_display_rotation_set`` writes it for the same turn given clockwise (16.16 fixed
    point; 2.30 for the last entry), or None for no rotation."""
    if not degrees % 360:
        return None
    rad = math.radians(degrees)
    c, s = (round(v * (1 << 16)) for v in (math.cos(rad), math.sin(rad)))
    return (c, -s, 0, s, c, 0, 0, 0, 1 << 30)


_side_data_types_named = False


def _name_side_data_types() -> None:
    """Give every side data type that PyAV's ``Type`` enum lacks a placeholder member.

    PyAV 18.1 names the types up to FFmpeg 7's; listing a frame's side data makes an
    enum member of each entry's type, and an unnamed one (``AV_FRAME_DATA_EXIF`` = 31
    in FFmpeg 8) raises ``ValueError`` for the whole list. A placeholder
    (``UNNAMED_31``) is what :class:`enum.Enum` returns for a value it holds; named
    types are left as they are. Idempotent.
    """
    global _side_data_types_named
    if _side_data_types_named:
        return
    import av.sidedata.sidedata as sd

    kind = sd.Type
    known = kind._value2member_map_
    for value in range(256):
        if value not in known:
            member = object.__new__(kind)
            member._value_ = value  # type: ignore[assignment]  # av stub: values typed as Type
            member._name_ = f"UNNAMED_{value}"
            known.setdefault(value, member)
    _side_data_types_named = True
