"""``hub-load``: loading a model by Hub id from a warm local Hub cache against the same
files given as a directory.

The checkpoint is laid out as a Hub cache entry
(:func:`mmserve.testing.hub_cache.write_hub_cache`) under a temporary ``HF_HOME`` with
``HF_HUB_OFFLINE=1`` (no network); each round loads it both ways
(:func:`mmserve.model.hub.resolve_model` then
:func:`~mmserve.model.loader.load_model` on the snapshot, and ``load_model`` on the
directory), in alternating order, after one warm-up load of each (page cache warm).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import report
from mmserve.model.hub import resolve_model
from mmserve.model.loader import load_model
from mmserve.testing.hub_cache import write_hub_cache

OPTIONS: list[tuple[tuple[str, ...], dict]] = [
    (("--repeats",), dict(type=int, default=7, help="rounds of both loads (median)")),
]

REPO = "mmserve-bench/model"


def _load(model: str, by_id: bool) -> tuple[float, float]:
    """Seconds to resolve and to load (resolution 0 for a directory)."""
    t0 = time.perf_counter()
    path = str(resolve_model(model).path) if by_id else model
    t1 = time.perf_counter()
    load_model(path)
    return t1 - t0, time.perf_counter() - t0


def hub_load(args: argparse.Namespace, model_dir: str) -> int:
    """``hub-load``: load seconds by Hub id (warm local cache) and by directory, medians
    of interleaved rounds."""
    saved = {k: os.environ.get(k) for k in ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE")}
    runs: dict[str, list[float]] = {"path": [], "hub_id": [], "resolve": []}
    with tempfile.TemporaryDirectory() as tmp:
        write_hub_cache(model_dir, Path(tmp) / "hub", REPO)
        os.sync()  # the copy's write-back must not overlap the timed loads
        os.environ.update(HF_HOME=tmp, HF_HUB_OFFLINE="1")
        os.environ.pop("HF_HUB_CACHE", None)
        try:
            _load(model_dir, False)  # warm-up: page cache, imports
            _load(REPO, True)
            for r in range(args.repeats):
                for case in ("path", "hub_id") if r % 2 == 0 else ("hub_id", "path"):
                    by_id = case == "hub_id"
                    resolve, total = _load(REPO if by_id else model_dir, by_id)
                    runs[case].append(total)
                    if case == "hub_id":
                        runs["resolve"].append(resolve)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    med = {k: statistics.median(v) for k, v in runs.items()}
    out = {
        "model": model_dir,
        "repeats": args.repeats,
        "seconds": runs,
        "median_s": med,
        "ratio_hub_over_path": med["hub_id"] / med["path"],
        "load_average": os.getloadavg()[0],
    }
    md = (
        f"checkpoint {model_dir}, {args.repeats} interleaved rounds (medians), "
        f"load average {out['load_average']:.1f}\n\n"
        "| load | seconds | of which resolving the id |\n| --- | --- | --- |\n"
        f"| directory | {med['path']:.3f} | - |\n"
        f"| Hub id, warm local cache | {med['hub_id']:.3f} | {med['resolve']:.4f} |\n"
        f"\nratio Hub id / directory: {out['ratio_hub_over_path']:.3f}\n"
    )
    return report.emit(args.out, "hub_load", out, md)
