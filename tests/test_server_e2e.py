"""End to end: a real ``mmserve serve`` process on 127.0.0.1, a photo, three questions."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.helpers import SAMPLES
from tests.live_server import live_server


def test_sample_client_against_real_server(model_dir: Path) -> None:
    args = ("--served-model-name", "tiny", "--max-total-tokens", "8192")
    with live_server(model_dir, *args) as server:
        out = subprocess.run(
            [sys.executable, str(SAMPLES.parent / "ask.py"), "--url", server, "--max-tokens", "4"],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout
        with urllib.request.urlopen(f"{server}/v1/cache/stats", timeout=10) as r:
            stats = json.loads(r.read())
    per_photo = [b for b in out.split("\n\n") if "id=img-" in b]
    assert len(per_photo) == 4, out
    for block in per_photo:
        cached = [
            int(line.split("cached=")[1].split()[0])
            for line in block.splitlines()
            if "cached=" in line
        ]
        assert len(cached) == 3, block
        assert cached[0] < 576 and all(c >= 576 for c in cached[1:]), block
    frac = float(out.rsplit("cached fraction of prompt tokens: ", 1)[1])
    assert frac > 0.6
    # the server at rest after the client: nothing running, every page free or in the
    # tree, the vision tower run once per photo
    assert stats["running_requests"] == 0
    assert stats["free_pages"] + stats["tree_pages"] == stats["pool_pages"]
    assert stats["vision_tower_images"] == 4
