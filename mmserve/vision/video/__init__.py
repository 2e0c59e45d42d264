"""Decode videos with PyAV (FFmpeg) and sample frames; every sampled frame becomes an image.

A frame is an RGB uint8 array turned into a PIL image and hashed like an
uploaded photo (:func:`mmserve.vision.hashing.image_key`), so identical frames
(a static scene, the same footage in two clips) share one key, one vision-tower
run and their KV. Frame selection is a pure function of the video's frame times,
duration, the request and its caps (:func:`sample_frame_indices`).

Four modules, one job each:

- :mod:`~mmserve.vision.video.select`: which frames a request takes (``num_frames``,
  ``fps``, ``timestamps``, frame and token budgets), the error and the limits.
- :mod:`~mmserve.vision.video.probe`: open a video and index its stream by demuxing
  (frame times, key frames, duration, frame rate).
- :mod:`~mmserve.vision.video.orientation`: the display matrix (rotation, mirroring).
- :mod:`~mmserve.vision.video.decode`: :class:`Video`, decoding the selected frames,
  damaged streams frame by frame.
"""

from mmserve.vision.video.decode import (
    DecodedFrames,
    FrameFailure,
    Video,
    undecodable_message,
)
from mmserve.vision.video.orientation import display_matrix, orient, rotation_matrix
from mmserve.vision.video.probe import VideoInfo
from mmserve.vision.video.select import (
    DEFAULT_NUM_FRAMES,
    SELECTORS,
    FrameCost,
    FrameSelection,
    VideoError,
    VideoLimits,
    sample_frame_indices,
)

__all__ = [
    "DEFAULT_NUM_FRAMES",
    "SELECTORS",
    "DecodedFrames",
    "FrameCost",
    "FrameFailure",
    "FrameSelection",
    "Video",
    "VideoError",
    "VideoInfo",
    "VideoLimits",
    "display_matrix",
    "orient",
    "rotation_matrix",
    "sample_frame_indices",
    "undecodable_message",
]
