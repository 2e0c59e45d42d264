"""``python -m benchmarks quant-rows`` at a CI scale: every candidate kernel runs on a
small matrix, interleaved, and the table names each one (issue 49 part 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import quant_rows
from benchmarks.__main__ import main
from mmserve.model import quant_onednn


def test_quant_rows_times_every_candidate(monkeypatch, tmp_path: Path) -> None:
    """One small shape, two row counts, one round: each kernel has a positive median, the
    oneDNN W8A8 column is there when this CPU chooses it, and the JSON says the load."""
    monkeypatch.setattr(quant_rows, "SHAPES", {"small 64x256": (64, 256)})
    args = ["quant-rows", "--rows", "1,8", "--rounds", "1", "--out", str(tmp_path)]
    assert main(args) == 0
    res = json.loads((tmp_path / "quant_rows.json").read_text())
    assert res["threads"] == torch.get_num_threads() and len(res["loadavg"]) == 3
    by_m = res["results"]["small 64x256"]
    assert sorted(by_m) == ["1", "8"]
    names = set(by_m["8"])
    assert {"bf16", "int8pack", "int8 w8a8", "int8 layer", "int4 kernel", "int4 layer"} <= names
    assert ("int8 w8a8 onednn" in names) == quant_onednn.available()
    assert all(v > 0 for d in by_m.values() for v in d.values())
    text = (tmp_path / "quant_rows.md").read_text()
    assert "int8 w8a8 onednn ms" in text or not quant_onednn.available()
    with pytest.raises(ValueError):
        main(["quant-rows", "--rows", "one", "--out", str(tmp_path)])
