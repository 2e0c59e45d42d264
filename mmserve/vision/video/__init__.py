"""Decode videos with PyAV (FFmpeg) and sample frames (being split)."""

from mmserve.vision.video.decode import (
    DEFAULT_NUM_FRAMES,
    SELECTORS,
    DecodedFrames,
    FrameCost,
    FrameFailure,
    FrameSelection,
    Video,
    VideoError,
    VideoInfo,
    VideoLimits,
    display_matrix,
    orient,
    rotation_matrix,
    sample_frame_indices,
    undecodable_message,
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
