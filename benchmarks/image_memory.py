"""Resident memory of the server under large allowed images (issue 20, item 2).

Starts ``mmserve serve`` (the bundled tiny model unless ``--model``) as a subprocess on
127.0.0.1, records its resident size (``VmRSS`` in ``/proc/PID/status``) at rest, then:

1. one chat request with eight distinct 6000x6000 PNGs (each within the per-image
   limit; about 0.9 MB of request in all);
2. two such requests at once (sixteen more distinct images).

During each phase a thread polls ``VmRSS`` every few milliseconds and keeps the
largest value (the kernel's own high-water mark ``VmHWM`` is printed too); after each
phase the resident size is read again once the server is idle. The table says how far
above the baseline each figure is; the baseline is taken after one text request and one
small image request (lazy imports and the vision tower's first buffers are not the
images' memory), "cold" after the text request only. ``--repo`` runs the server from
another checkout (e.g. the main branch) for a side-by-side figure from the same images.

Usage::

    python -m benchmarks.image_memory [--repo PATH] [--model DIR] [--side 6000]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks.servers import free_port, stop_process, wait_healthy

MB = 1 << 20


def status_kb(pid: int, field: str) -> int:
    """``field`` (``VmRSS``, ``VmHWM``) of ``/proc/pid/status`` in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class PeakRSS:
    """Polls a process's ``VmRSS`` on a thread and keeps the largest value (bytes)."""

    def __init__(self, pid: int, every: float = 0.005) -> None:
        self.pid, self.every = pid, every
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, status_kb(self.pid, "VmRSS") * 1024)
            except (OSError, KeyError):
                return
            self._stop.wait(self.every)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def big_png(side: int, seed: int) -> bytes:
    """A ``side`` x ``side`` RGB PNG that compresses well (stripes and a gradient) and
    differs from every other seed's (so each is a distinct image and key)."""
    x = np.arange(side, dtype=np.int64)
    period = 40 + seed
    row = ((x // period) % 2 * 200 + seed * 7) % 256
    col = (x * 255 // side).astype(np.int64)
    r = np.broadcast_to(row[None, :], (side, side))
    g = np.broadcast_to(col[:, None], (side, side))
    b = np.full((side, side), (seed * 37) % 256)
    arr = np.stack([r, g, b], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, "PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def chat_body(images: list[bytes]) -> bytes:
    parts = [
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(d).decode()},
        }
        for d in images
    ]
    parts.append({"type": "text", "text": "Describe the pictures."})
    body = {
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 4,
        "temperature": 0,
    }
    return json.dumps(body).encode()


def post(url: str, body: bytes, timeout: float = 900) -> tuple[int, str]:
    req = urllib.request.Request(
        url + "/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@contextmanager
def server(repo: Path, model: str | None, flags: list[str]) -> Iterator[tuple[str, int]]:
    """``mmserve serve`` from ``repo`` on a free 127.0.0.1 port; yields (url, pid)."""
    port = free_port()
    cmd = [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--log-level", "warning", *(["--model", model] if model else []), *flags]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "2"}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, 300, log)
            yield url, proc.pid
        finally:
            stop_process(proc)


def settle(pid: int, seconds: float) -> int:
    """``VmRSS`` (bytes) after ``seconds`` of idling."""
    time.sleep(seconds)
    return status_kb(pid, "VmRSS") * 1024


def measure(repo: Path, model: str | None, side: int, flags: list[str]) -> dict:
    """Baseline, peak and after figures (bytes) of the two phases, and the answers' status."""
    print(f"making 24 distinct {side}x{side} PNGs ...", file=sys.stderr)
    pngs = [big_png(side, s) for s in range(24)]
    bodies = [chat_body(pngs[k * 8 : (k + 1) * 8]) for k in range(3)]
    out: dict = {"request_bytes": len(bodies[0]), "png_bytes": sum(map(len, pngs[:8]))}
    with server(repo, model, flags) as (url, pid):
        post(url, json.dumps({"messages": [{"role": "user", "content": "Hi"}]}).encode())
        out["cold"] = settle(pid, 1.0)
        # warm: the image path once (lazy imports, the tower's first buffers)
        post(url, chat_body([big_png(64, 99)]))
        out["baseline"] = settle(pid, 2.0)
        with PeakRSS(pid) as one:
            status, text = post(url, bodies[0])
        out["one_status"] = status
        out["one_error"] = text[:300] if status != 200 else ""
        out["one_peak"] = one.peak
        out["one_after"] = settle(pid, 3.0)
        with PeakRSS(pid) as two:
            results: list[tuple[int, str]] = [(0, "")] * 2

            def send(k: int) -> None:
                results[k] = post(url, bodies[1 + k])

            threads = [threading.Thread(target=send, args=(k,)) for k in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        out["two_status"] = [s for s, _ in results]
        out["two_peak"] = two.peak
        out["two_after"] = settle(pid, 3.0)
        out["hwm"] = status_kb(pid, "VmHWM") * 1024
    return out


def table(rows: dict[str, dict]) -> str:
    """Markdown table of the figures (MB, and MB above the baseline)."""
    lines = [
        "| server | cold | baseline | 1 request: peak | after | 2 at once: peak | after "
        "| VmHWM | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        base = r["baseline"]

        def f(v: int, b: int = base) -> str:
            return f"{v / MB:.0f} (+{(v - b) / MB:.0f})"

        status = f"{r['one_status']}, {r['two_status']}"
        lines.append(
            f"| {name} | {r['cold'] / MB:.0f} | {base / MB:.0f} | {f(r['one_peak'])} | "
            f"{f(r['one_after'])} | {f(r['two_peak'])} | {f(r['two_after'])} | "
            f"{r['hwm'] / MB:.0f} | {status} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = Path(__file__).resolve().parents[1]
    ap.add_argument("--repo", action="append", default=None, help="checkout(s) to run")
    ap.add_argument("--model", default=None, help="model dir (default: bundled tiny model)")
    ap.add_argument("--side", type=int, default=6000, help="image side (pixels)")
    ap.add_argument("--json", default=None, help="write the figures here too")
    ap.add_argument("flags", nargs="*", help="extra `mmserve serve` flags (after --)")
    args = ap.parse_args(argv)
    rows = {}
    for repo in [Path(r).resolve() for r in (args.repo or [str(here)])]:
        r = measure(repo, args.model, args.side, args.flags)
        rows[str(repo)] = r
        if r["one_error"]:
            print(f"{repo}: first request answered {r['one_status']}: {r['one_error']}")
    print(
        f"eight distinct {args.side}x{args.side} PNGs per request "
        f"({rows[next(iter(rows))]['request_bytes'] / MB:.2f} MB of JSON); resident MB"
    )
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
