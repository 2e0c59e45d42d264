"""``image-repeat``: the API process's CPU per request that repeats an image whose
features the engine process already holds (issue 41: the front end's mirror of the engine's
embedding-cache keys).

``mmserve serve`` (the process split) from this checkout and from each ``--repo`` (a
checkout of the code before, say), on the same model. Per server a warm-up sends the photo
(a ``--side`` x 3/4 JPEG) once by data URL and once by the id of its upload, so the engine
holds its features; then per round (servers interleaved, alternating order),
``--requests`` requests one after another, each that photo and a question
(``max_tokens`` 1), first as a data URL, then by image id. Measured per request: the API
process's CPU (its threads' schedstat time; the engine process is its child and counted
apart), the engine process's CPU, and the wall time; medians over rounds. Also the vision
tower runs of each server (1: the warm-up).
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

from benchmarks import over_http as http
from benchmarks import report, workloads
from benchmarks.host import cpu_by_process

KINDS = ("data URL", "image id")
TABLE = (
    "server, image as|API CPU ms / request=api_cpu_ms|engine CPU ms / request=engine_cpu_ms"
    "|ms / request=wall_ms"
)


def photo(side: int) -> bytes:
    """The astronaut sample resized to ``side`` x ``side * 3 // 4``, as a JPEG."""
    im = Image.open(workloads.SAMPLES_DIR / "astronaut.png").convert("RGB")
    buf = io.BytesIO()
    im.resize((side, side * 3 // 4), Image.Resampling.BICUBIC).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _ask(client: httpx.Client, url: str, image_url: str, i: int) -> None:
    content = [
        {"type": "image_url", "image_url": {"url": image_url}},
        {"type": "text", "text": f"What is in this photo? ({i % 7})"},
    ]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
    r = client.post(f"{url}/v1/chat/completions", json=body)
    r.raise_for_status()


def _measure(client: httpx.Client, url: str, pid: int, image_url: str, n: int) -> dict:
    """``n`` requests one after another: API and engine CPU ms and wall ms per request."""
    before, t0 = cpu_by_process(pid), time.perf_counter()
    for i in range(n):
        _ask(client, url, image_url, i)
    wall, after = time.perf_counter() - t0, cpu_by_process(pid)
    api = after.get(pid, 0.0) - before.get(pid, 0.0)
    engine = sum(c - before.get(p, 0.0) for p, c in after.items() if p != pid)
    return {
        "api_cpu_ms": 1e3 * api / n,
        "engine_cpu_ms": 1e3 * engine / n,
        "wall_ms": 1e3 * wall / n,
    }


def image_repeat(args: argparse.Namespace, model_dir: str) -> int:
    """Per server (this checkout, each ``--repo``) and way of naming the image: CPU and
    wall time per repeated-image request (interleaved rounds, medians).

    Returns:
        0; the results go to ``--out`` as ``image_repeat.json`` / ``.md``.
    """
    rounds, n = (1, 2) if args.scale == "ci" else (args.rounds, args.requests)
    side = 320 if args.scale == "ci" else args.side
    data = photo(side)
    durl = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    repos = {"this checkout": workloads.ROOT}
    repos |= {str(Path(r).resolve()): Path(r).resolve() for r in args.repo or []}
    runs: dict[tuple[str, str], list[dict]] = {(s, k): [] for s in repos for k in KINDS}
    towers: dict[str, int] = {}
    with ExitStack() as stack, httpx.Client(timeout=300) as client:
        servers: dict[str, tuple[str, int, str]] = {}
        for name, repo in repos.items():
            url, proc = stack.enter_context(http.mmserve_server(model_dir, (), 1, repo=repo))
            up = client.post(f"{url}/v1/images", files={"file": ("photo.jpg", data)})
            up.raise_for_status()
            servers[name] = (url, proc.pid, up.json()["id"])
            for image_url in (durl, up.json()["id"]):  # warm-up: the engine holds it
                _ask(client, url, image_url, -1)
        for r in range(rounds):
            for name in list(servers) if r % 2 == 0 else list(reversed(servers)):
                url, pid, image_id = servers[name]
                for kind, image_url in zip(KINDS, (durl, image_id), strict=True):
                    runs[(name, kind)].append(_measure(client, url, pid, image_url, n))
        for name, (url, _, _) in servers.items():
            towers[name] = int(http.get_json(f"{url}/v1/cache/stats")["vision_tower_images"])
    med = statistics.median
    rows: dict[str, dict[str, Any]] = {
        f"{s}, {k}": {
            key: med(x[key] for x in v) for key in ("api_cpu_ms", "engine_cpu_ms", "wall_ms")
        }
        for (s, k), v in runs.items()
    }
    out = {
        "meta": {"side": side, "rounds": rounds, "requests": n, "load": report.loadavg()},
        "rows": rows,
        "tower_runs": towers,
        "runs": {f"{s}, {k}": v for (s, k), v in runs.items()},
    }
    md = (
        f"## Repeated image (`image-repeat`)\n\nA {side}x{side * 3 // 4} JPEG, {n} requests"
        f" x {rounds} rounds per server and way, medians; load {report.loadavg()}\n\n"
        + report.table(rows, TABLE)
        + f"\n\nvision tower runs per server: {towers}"
    )
    return report.emit(args.out, "image_repeat", out, md)


OPTIONS = [
    (("--repo",), dict(action="append", help="another checkout to run the server from")),
    (("--rounds",), dict(type=int, default=5, help="interleaved rounds")),
    (("--requests",), dict(type=int, default=20, help="requests per round, server and way")),
    (("--side",), dict(type=int, default=1280, help="photo width (pixels; height 3/4 of it)")),
]
