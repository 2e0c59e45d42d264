"""HTTP-server flags of ``mmserve serve`` (limits, uploads, image sources, API key).

They end up in ``api.settings.ServerSettings`` (and two image limits in the
engine config) through the ``MMSERVE_SERVER_CONFIG`` JSON, so nothing here
imports :mod:`api`.
"""

from __future__ import annotations

import argparse

from mmserve.vision.image import ImageLimits


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Add the server flags to the ``serve`` subcommand's parser."""
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(default: $MMSERVE_API_KEY; unset: no key)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests waiting for their first token beyond which new ones get 503",
    )
    p.add_argument(
        "--max-request-bytes", type=int, default=64 << 20, help="largest request body (bytes)"
    )
    p.add_argument(
        "--max-image-bytes",
        type=int,
        default=ImageLimits().max_bytes,
        help="largest encoded image (bytes)",
    )
    p.add_argument("--max-images-per-request", type=int, default=8)
    p.add_argument("--max-stored-images", type=int, default=256, help="upload store: images")
    p.add_argument(
        "--max-stored-image-bytes",
        type=int,
        default=1 << 30,
        help="upload store: decoded pixel bytes",
    )
    p.add_argument(
        "--max-video-bytes", type=int, default=64 << 20, help="largest encoded video (bytes)"
    )
    p.add_argument(
        "--max-video-frames", type=int, default=64, help="most frames sampled per request"
    )
    p.add_argument(
        "--max-video-side", type=int, default=3840, help="largest video frame side (pixels)"
    )
    p.add_argument("--max-stored-videos", type=int, default=32, help="upload store: videos")
    p.add_argument(
        "--image-store-dir",
        default=None,
        help="keep uploaded images in this directory, across restarts",
    )
    p.add_argument(
        "--allow-remote-images",
        action="store_true",
        help="fetch http(s) image URLs (default: refused; clients upload instead)",
    )
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="allow file:// image URLs inside this directory (default: refused)",
    )


def apply_server_args(args: argparse.Namespace, settings: dict) -> None:
    """Put the server flags into ``settings`` (the engine config as a dict, from ``asdict``)."""
    settings["max_images_per_request"] = args.max_images_per_request
    settings.setdefault("image_limits", {})["max_bytes"] = args.max_image_bytes
    settings["server"] = {
        "served_model_name": args.served_model_name,
        "api_key": args.api_key,
        "max_queued_requests": args.max_queued_requests,
        "max_request_bytes": args.max_request_bytes,
        "max_stored_images": args.max_stored_images,
        "max_stored_image_bytes": args.max_stored_image_bytes,
        "image_store_dir": args.image_store_dir,
        "allow_remote_images": args.allow_remote_images,
        "allowed_local_media_path": args.allowed_local_media_path,
        "max_video_bytes": args.max_video_bytes,
        "max_video_frames": args.max_video_frames,
        "max_video_side": args.max_video_side,
        "max_stored_videos": args.max_stored_videos,
    }
