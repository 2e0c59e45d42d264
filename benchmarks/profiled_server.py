"""``mmserve serve`` under cProfile, every thread profiled (``python -m
benchmarks.profiled_server serve ...``, the launcher of the HTTP-overhead profile):
``SIGUSR1`` clears the profiles, ``SIGUSR2`` writes ``$MMSERVE_PROFILE_OUT``;
:func:`breakdown` sums them by category."""

from __future__ import annotations

import cProfile
import os
import pickle
import pstats
import signal
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

_profiles: list[tuple[str, cProfile.Profile]] = []
_lock = threading.Lock()

#: Self-time categories, first match wins: (name, substrings of "file:function").
CATEGORIES = (
    ("JSON (parse, dump)", ("json/", "_json", "json.", "orjson")),
    ("pydantic validation", ("pydantic",)),
    ("base64 / data URL", ("base64", "binascii", "b2a_", "a2b_", "api/media.py")),
    ("image decode + hash", ("PIL/", "PIL.", "Imaging", "xxhash", "mmserve/vision/")),
    ("tokenize + chat template", ("tokenizers", "tokenization", "jinja2", "frontend/prompt.py",
                                  "frontend/processor.py", "api/generation.py")),
    ("SSE chunks", ("api/openai_format.py", "sse", "StreamingResponse")),
    ("event loop + HTTP", ("asyncio", "uvicorn", "h11", "httptools", "starlette", "fastapi",
                           "anyio", "selectors", "socket", "api/", "concurrent/futures",
                           "threading.py", "queue.py")),
    ("engine (model, scheduler, cache)", ("mmserve/", "torch")),
)  # fmt: skip
#: Blocking waits are self time in cProfile; they are left out.
WAITS = ("select", "acquire", "wait", "sleep", "epoll", "poll", "_worker")


def category(filename: str, func: str) -> str:
    """The :data:`CATEGORIES` name of a profiled function, else "other"."""
    text = f"{filename}:{func}"
    return next((n for n, needles in CATEGORIES if any(x in text for x in needles)), "other")


def breakdown(profile_path: Path) -> dict[str, Any]:
    """Busy self time per thread, and of the non-engine threads by category (a C
    function's time, file ``~``, goes to its callers' categories in proportion)."""
    stats: dict[str, dict] = pickle.loads(Path(profile_path).read_bytes())
    threads, cats = {}, defaultdict(float)
    for name, st in stats.items():
        busy = {k: v for k, v in st.items() if not any(w in k[2] for w in WAITS)}
        threads[name] = sum(v[2] for v in busy.values())
        if name.startswith("mmserve-engine"):
            continue
        for (file, _, func), (_, _, tt, _, callers) in busy.items():
            if file != "~" or not callers:
                cats[category(file, func)] += tt
                continue
            total = sum(c[2] for c in callers.values()) or 1.0
            for caller, c in callers.items():
                cats[category(caller[0], caller[2])] += tt * c[2] / total
    ranked = dict(sorted(cats.items(), key=lambda kv: -kv[1]))
    work = [k for k in ranked if not k.startswith("engine") and k != "other"]
    return {
        "threads_s": dict(sorted(threads.items(), key=lambda kv: -kv[1])),
        "categories_s": ranked,
        "largest": work[0] if work else None,
        "note": "cProfile self time (Python-heavy code inflated against C); engine thread "
        "whole, other threads by category",
    }


def _start_thread_profile(*_: Any) -> None:
    sys.setprofile(None)
    p = cProfile.Profile()
    with _lock:
        _profiles.append((threading.current_thread().name, p))
    p.enable()


def _dump(path: str) -> None:
    out: dict[str, dict] = {}
    with _lock:
        profiles = list(_profiles)
    for name, p in profiles:
        try:
            st = pstats.Stats(p).stats  # type: ignore[attr-defined]
        except (TypeError, ValueError):  # never recorded anything
            continue
        key, i = name, 1
        while key in out:
            key, i = f"{name}#{i + 1}", i + 1
        out[key] = st
    with open(f"{path}.tmp", "wb") as f:
        pickle.dump(out, f)
    os.replace(f"{path}.tmp", path)  # readers never see half a file


def main() -> int:
    """``api.cli.main(sys.argv[1:])`` profiled; the profiles are written on exit too."""
    from api.cli import main as cli_main

    path = os.environ.get("MMSERVE_PROFILE_OUT", "mmserve-profile.pkl")
    signal.signal(signal.SIGUSR1, lambda *_: [p.clear() for _, p in list(_profiles)])
    signal.signal(signal.SIGUSR2, lambda *_: _dump(path))
    threading.setprofile(_start_thread_profile)
    main_prof = cProfile.Profile()
    _profiles.append(("MainThread", main_prof))
    main_prof.enable()
    try:
        return cli_main(sys.argv[1:])
    finally:
        main_prof.disable()
        threading.setprofile(None)
        _dump(path if not os.path.exists(path) else f"{path}.exit")


if __name__ == "__main__":
    raise SystemExit(main())
