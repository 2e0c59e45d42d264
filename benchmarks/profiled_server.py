"""``mmserve serve`` under cProfile, every thread profiled (for the HTTP-overhead figure).

``python -m benchmarks.profiled_server serve --model DIR ...`` runs the normal CLI
with a ``cProfile.Profile`` in the main thread (uvicorn's event loop) and one per
thread started afterwards (the engine thread, the worker threads that decode
images and tokenize). ``SIGUSR1`` clears every profile (so start-up and warm-up are
left out), ``SIGUSR2`` writes ``$MMSERVE_PROFILE_OUT`` (a pickle of ``{thread name:
pstats stats dict}``) for :func:`benchmarks.http_overhead.breakdown`; on exit the
profiles go there too (to ``<path>.exit`` if it already exists).
"""

from __future__ import annotations

import cProfile
import os
import pickle
import pstats
import signal
import sys
import threading

_profiles: list[tuple[str, cProfile.Profile]] = []
_lock = threading.Lock()


def _start_thread_profile(frame, event, arg):  # noqa: ANN001, ANN202 - sys.setprofile hook
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
            st = pstats.Stats(p)
        except (TypeError, ValueError):  # a profile that never recorded anything
            continue
        key = name
        i = 1
        while key in out:
            i += 1
            key = f"{name}#{i}"
        out[key] = st.stats  # type: ignore[attr-defined]
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(out, f)
    os.replace(tmp, path)  # readers never see half a file


def _clear(*_: object) -> None:
    with _lock:
        for _, p in _profiles:
            p.clear()


def main() -> int:
    """Run ``api.cli.main(sys.argv[1:])`` profiled; write the profiles on exit."""
    from api.cli import main as cli_main

    path = os.environ.get("MMSERVE_PROFILE_OUT", "mmserve-profile.pkl")
    signal.signal(signal.SIGUSR1, _clear)
    signal.signal(signal.SIGUSR2, lambda *_: _dump(path))
    threading.setprofile(_start_thread_profile)
    main_prof = cProfile.Profile()
    with _lock:
        _profiles.append(("MainThread", main_prof))
    main_prof.enable()
    try:
        rc = cli_main(sys.argv[1:])
    finally:
        main_prof.disable()
        threading.setprofile(None)
        _dump(path if not os.path.exists(path) else f"{path}.exit")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
