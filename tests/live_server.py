"""A real ``mmserve serve`` subprocess on a free 127.0.0.1 port, for end-to-end tests, and
the app in-process behind a ``TestClient`` (:func:`app_client`).

Apart from ``tests/helpers.py``: the GPU check imports that one, and its image has no
FastAPI (tests/test_gpu_bundle.py)."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.app import ServerSettings, create_app, start_engine_process
from benchmarks.over_http import free_port, server
from mmserve.frontend.frontend import Engine
from tests.helpers import MODEL, fail_prefill_engine_main, failing_while, split_mode

__all__ = ["free_port", "live_server", "live_server_process", "uvicorn_thread"]


@contextmanager
def live_server(
    model_dir: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> Iterator[str]:
    """Run ``mmserve serve --model model_dir *args`` and yield its base URL once healthy."""
    with live_server_process(model_dir, *args, env=env, timeout=timeout) as (url, _):
        yield url


@contextmanager
def live_server_process(
    model_dir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    log_path: Path | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Like :func:`live_server`, yielding ``(url, process)``; the process is stopped after
    (benchmarks' :func:`~benchmarks.over_http.server`). float32 unless ``args`` name a
    ``--dtype``: tests compare servers with each other and with float32 references, and
    ``--dtype auto`` is bfloat16 on CPUs that have it. Its output and log go to
    ``log_path`` when given.

    Raises:
        RuntimeError: the server exited or was not healthy in ``timeout`` s (with its log).
    """
    if "--dtype" not in args:
        args = (*args, "--dtype", "float32")
    cmd = [sys.executable, "-m", "api.cli", "serve", "--model", str(model_dir), *args]
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    with server(cmd, env, log_path=log_path, timeout=timeout) as got:
        yield got


def get_json(url: str, headers: dict[str, str] | None = None) -> dict:
    """GET ``url`` and parse its JSON body."""
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def metric(
    text: str, name: str, labels: dict[str, str] | None = None, default: float | None = None
) -> float:
    """One sample's value from Prometheus text (``default``, else ``KeyError``, if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and (labels is None or s.labels == labels):
                return s.value
    if default is not None:
        return default
    raise KeyError(name)


def child_pids(pid: int) -> list[int]:
    """Process ids of ``pid``'s children and their descendants (Linux ``/proc``)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
        for k in kids:
            out += [k, *child_pids(k)]
    return out


def cmdline(pid: int) -> str:
    """``pid``'s command line with spaces between arguments ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def parent_pid(pid: int) -> int | None:
    """``pid``'s parent's pid (None once it is gone; Linux ``/proc``)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (Linux ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds for ``pids`` to exit; returns those still alive."""
    deadline = time.time() + timeout
    while True:
        alive = [p for p in pids if pid_alive(p)]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


#: Set to 1: :func:`app_client`, and every ``create_app(engine)`` of the tests
#: (tests/conftest.py swaps in :func:`split_create_app`), serve from an engine process
#: started with the engine's settings (the process split of ``mmserve serve``).
def engine_pid(server: subprocess.Popen) -> int:
    """The pid of ``server``'s engine process (its one spawned child)."""
    pids = [p for p in child_pids(server.pid) if "spawn_main" in cmdline(p)]
    assert len(pids) == 1, [(p, cmdline(p)) for p in child_pids(server.pid)]
    return pids[0]


def wait_health(url: str, code: int, timeout: float) -> float:
    """Wait until ``url``'s ``/health`` answers ``code``; returns the seconds it took.

    Raises:
        AssertionError: it did not within ``timeout`` s.
    """
    start = time.time()
    while time.time() - start < timeout:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == code:
                return time.time() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"/health never answered {code} in {timeout} s")


def split_create_app(engine, settings=None, tracing=None, process=None, **options) -> FastAPI:
    """:func:`api.app.create_app` as the process-split server builds it: for an in-process
    ``Engine``, an engine process loads its checkpoint with its settings (in its model's
    dtype) and ``engine`` serves nothing; the app's shutdown stops that process (and so
    does this interpreter's exit, for an app never started). Anything else is passed on.
    ``options``: more :class:`~mmserve.frontend.engine_client.EngineProcessClient`
    arguments.
    """
    if process is not None or not isinstance(engine, Engine):
        return _create_app(engine, settings, tracing, process=process)
    config = dataclasses.replace(engine.config, dtype=engine.describe()["dtype"])
    front, process = start_engine_process(config, restarts=0, **options)
    atexit.register(process.stop)
    return _create_app(front, settings, tracing, process=process)


_create_app = create_app


def app_failing_prefill(engine: Engine, flag: Path, **settings) -> FastAPI:
    """The app of ``engine`` (:func:`app_client`'s settings) whose prefills raise
    ``RuntimeError("injected /secret/path")`` while the file ``flag`` exists: the
    in-process engine's runner patched, or in the process-split run (:func:`split_mode`)
    an engine process started with :func:`tests.helpers.fail_prefill_engine_main`."""
    settings.setdefault("served_model_name", MODEL)
    if not split_mode():
        engine.runner.prefill = failing_while(flag, engine.runner.prefill)
        return _create_app(engine, ServerSettings(**settings))
    target = functools.partial(fail_prefill_engine_main, flag=str(flag))
    return split_create_app(engine, ServerSettings(**settings), target=target)


@contextmanager
def app_client(
    engine: Engine, engine_process: bool | None = None, **settings
) -> Iterator[TestClient]:
    """A ``TestClient`` (lifespan run) on ``create_app(engine, ServerSettings(**settings))``;
    the model is served as ``tests.helpers.MODEL`` unless ``settings`` name another.

    With ``engine_process`` (default: :func:`split_mode`) the app is the process-split
    server's (:func:`split_create_app`).
    """
    settings.setdefault("served_model_name", MODEL)
    split = split_mode() if engine_process is None else engine_process
    build = split_create_app if split else _create_app
    with TestClient(build(engine, ServerSettings(**settings))) as c:
        yield c


@contextmanager
def uvicorn_thread(app: FastAPI, timeout: float = 30) -> Iterator[str]:
    """Serve ``app`` (lifespan run) with a real uvicorn on a free 127.0.0.1 port, in a
    thread of this process, so a test can reach the engine's objects while real sockets
    connect and hang up; yields the base URL and stops the server after (seconds:
    ``timeout`` each way).

    Raises:
        AssertionError: uvicorn did not start in ``timeout`` s.
    """
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + timeout
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout)
