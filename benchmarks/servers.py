"""Server processes for the HTTP benchmark: mmserve (cache on / off) and their CPU time.

Each server runs as its own process on a free 127.0.0.1 port with the thread count
the benchmark sets (``OMP_NUM_THREADS`` and torch's intra-op threads for mmserve,
``-t``/``-tb`` for llama.cpp); the benchmark reads the process's CPU seconds from
``/proc`` around each run, so a figure that other processes on the machine inflate
(wall time) comes with one they do not (the server's own CPU time).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

#: ``mmserve serve`` flags of the two mmserve systems.
MMSERVE_SYSTEMS: dict[str, list[str]] = {
    "mmserve": [],
    "mmserve-off": ["--disable-radix-cache", "--vision-cache-bytes", "0"],
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: IO[bytes]) -> None:
    """Wait until ``GET url/health`` answers 200.

    Raises:
        RuntimeError: the process exited, or ``timeout`` seconds passed (with its log's tail).
    """
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}): {_tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.time() > deadline:
            raise RuntimeError(f"server not healthy after {timeout:.0f} s: {_tail(log)}")
        time.sleep(0.25)


def _tail(log: IO[bytes]) -> str:
    try:
        log.flush()
        log.seek(0)
        return log.read().decode(errors="replace")[-2000:]
    except (OSError, ValueError):
        return ""


def stop_process(proc: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads), None off Linux."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime


@contextmanager
def mmserve_server(
    model_dir: str | Path,
    flags: list[str],
    threads: int = 1,
    log_path: Path | None = None,
    timeout: float = 180,
    launcher: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run ``mmserve serve --model model_dir *flags``; yields ``(url, process)`` once healthy.

    Args:
        threads: ``OMP_NUM_THREADS`` (torch's intra-op threads follow it).
        launcher: the Python command that runs the CLI (default ``python -m api.cli``;
            the HTTP-overhead profile passes ``benchmarks.profiled_server``).
    """
    port = free_port()
    log = open(log_path, "w+b") if log_path else tempfile.TemporaryFile()  # noqa: SIM115
    cmd = [*(launcher or [sys.executable, "-m", "api.cli"]), "serve", "--model", str(model_dir)]
    cmd += ["--port", str(port), "--log-level", "warning", "--max-queued-requests", "4096"]
    proc = subprocess.Popen(
        cmd + list(flags),
        env={
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            **(env or {}),
        },
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=Path(__file__).resolve().parents[1],
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout, log)
        yield url, proc
    finally:
        stop_process(proc)
        log.close()
