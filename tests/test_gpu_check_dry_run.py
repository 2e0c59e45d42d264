"""``GPU_CHECK_DRY_RUN=1 scripts/gpu_check.sh OUT_DIR`` with no GPU (issue 48): the
check's plan is run here, every GPU phase reports "skipped: no GPU" in order, the
files it writes and its phases' time limits are counted from ``summary.json``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
CHECK_SH = ROOT / "scripts" / "gpu_check.sh"
#: the phases of a run on one GPU, in order
PHASES = [
    "install (offline)",
    "environment",
    "prebuild FlashInfer kernels",
    "pytest tests/gpu + reference",
    "pytest quantized",
    "quantized matmul timing",
    "pytest --tp 2 (2 GPUs)",
    "benchmark many_questions",
    "graph decode (onevision-0.5b)",
    "speculation (onevision-0.5b)",
]
#: what comes back from a lent machine: at most 8 files, in a 600 s command
MAX_FILES, BUDGET_S = 8, 480


def _dry_run(out: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "PYTHON": sys.executable, **extra}
    env["GPU_BUNDLE"] = str(out.parent / "no-bundle")
    for name in ("OUT", "GPU_CHECK_ONLY"):
        env.pop(name, None)
    return subprocess.run(
        ["bash", str(CHECK_SH), str(out)], env=env, capture_output=True, text=True, timeout=120
    )


def test_dry_run_plans_every_phase_within_the_budget(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _dry_run(out)
    log = (out / "gpu_check.log").read_text()
    assert proc.returncode == 0, log
    s = json.loads((out / "summary.json").read_text())
    assert s["mode"] == "dry run" and s["complete"] and s["passed"]
    assert [p["name"] for p in s["phases"]] == PHASES
    statuses = {p["name"]: p["status"] for p in s["phases"]}
    assert statuses.pop("install (offline)") == "skipped: no bundle"
    assert statuses.pop("environment") == "ok"
    assert set(statuses.values()) == {"skipped: no GPU"}
    # the skip lines come in the plan's order in the log too
    skips = [line for line in log.splitlines() if line.endswith("skipped: no GPU (dry run) ===")]
    assert [line.split(" (limit")[0].removeprefix("=== ") for line in skips] == PHASES[2:]
    limits = [p["limit_s"] for p in s["phases"]]
    assert s["total_limit_s"] == sum(limits) <= BUDGET_S == s["budget_s"]
    assert all(p["limit_s"] > 0 for p in s["phases"] if p["name"] != "pytest --tp 2 (2 GPUs)")  # 0
    assert f"phase limits add up to {sum(limits)}s (budget {BUDGET_S}s)" in log
    # files: a full run's, counted; this one's, a subset
    assert len(s["files_planned"]) <= MAX_FILES
    assert "summary.json" in s["files_planned"]
    assert sorted(p.name for p in out.iterdir()) == s["files"] == ["gpu_check.log", "summary.json"]
    assert set(s["files"]) <= set(s["files_planned"])
    # the versions it ran with
    assert s["ran_with"]["torch"] == torch.__version__
    assert s["ran_with"]["transformers"] == transformers.__version__
    # what --deterministic runs, asked of the code: FlashInfer refused, so nothing to time
    assert s["versions"]["deterministic"].startswith("torch backend only: --deterministic refuses")
    assert s["fp16"].startswith("dropped: no precompiled kernels")


def test_limits_over_the_budget_refuse_to_start(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _dry_run(out, PYTEST_TIMEOUT="300")
    assert proc.returncode == 2
    s = json.loads((out / "summary.json").read_text())
    assert s["total_limit_s"] == 480 - 90 + 300 and not s["complete"] and not s["passed"]
    assert {p["status"] for p in s["phases"]} == {"pending"}  # nothing ran
    assert "the limits exceed the budget: not starting" in (out / "gpu_check.log").read_text()


def test_a_run_cut_off_midway_leaves_its_finished_phases(tmp_path: Path) -> None:
    """summary.json is written before the first phase and after each: a check killed
    while a phase runs (its 600 s command cut off) leaves the phases before it."""
    stall = tmp_path / "python"  # the environment phase hangs; everything else is Python
    stall.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-" ]; then\n'
        '  f=$(mktemp); cat > "$f"\n'
        '  if grep -q setup_only "$f"; then touch "$STALLED"; sleep 60; fi\n'
        f'  shift; exec {sys.executable} "$f" "$@"\n'
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    stall.chmod(0o755)
    out, stalled = tmp_path / "out", tmp_path / "stalled"
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "PYTHON": str(stall),
           "STALLED": str(stalled), "GPU_BUNDLE": str(tmp_path / "no-bundle"),
           "TMPDIR": str(tmp_path)}  # fmt: skip
    env.pop("OUT", None)
    proc = subprocess.Popen(
        ["bash", str(CHECK_SH), str(out)], env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not stalled.exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    s = json.loads((out / "summary.json").read_text())
    assert not s["complete"] and not s["passed"]
    assert [p["name"] for p in s["phases"]] == PHASES
    assert [p["status"] for p in s["phases"]] == ["skipped: no bundle"] + ["pending"] * (
        len(PHASES) - 1
    )
    assert s["total_limit_s"] <= BUDGET_S
