"""Build samples/video/pans.mp4 from the sample photographs: a few seconds of pans and cuts.

Usage: python samples/make_video.py [OUT.mp4]

Each photo gets one second at 10 fps: half a second held still, then a pan
across it; hard cuts between photos. (A lossy encoder refines a still shot over
its first frames, so held frames decode almost, not always exactly, equal.)
320x240, H.264 (yuv420p) in MP4, written with PyAV (``pip install av``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import av
import numpy as np
from PIL import Image

HERE = Path(__file__).parent
W, H, FPS = 320, 240, 10
PHOTOS = ["astronaut.png", "cat.png", "coffee.png", "rocket.jpg"]


def frames_of(photo: Path) -> list[np.ndarray]:
    """Five still frames, then five frames panning left to right."""
    im = Image.open(photo).convert("RGB")
    scale = H / im.height * 1.25
    im = im.resize((max(W + 40, round(im.width * scale)), round(im.height * scale)))
    top = (im.height - H) // 2
    xs = [0] * 5 + [round((im.width - W) * k / 5) for k in range(1, 6)]
    return [np.asarray(im.crop((x, top, x + W, top + H))) for x in xs]


def main(out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(out), "w") as c:
        s = c.add_stream("libx264", rate=FPS)
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        s.options = {"crf": "28", "preset": "veryslow"}
        for name in PHOTOS:
            for f in frames_of(HERE / "images" / name):
                for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                    c.mux(p)
        for p in s.encode():
            c.mux(p)
    print(f"wrote {out} ({out.stat().st_size} bytes, {len(PHOTOS) * 10} frames at {FPS} fps)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "video" / "pans.mp4")
