"""``python -m benchmarks plot`` (benchmarks/plot.py): every plot drawn from the small
fixture results in tests/plot_results/ (one file per benchmark, in the shape that
benchmark writes), files written and non-empty PNG; plots without their JSON are skipped
with a note. The pixels are not checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks import plot
from benchmarks.__main__ import main

FIXTURES = Path(__file__).parent / "plot_results"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    return data.startswith(PNG_SIGNATURE) and len(data) > 1000


def test_every_plot_is_drawn_from_the_fixture_results(tmp_path: Path) -> None:
    got = plot.plot_all(FIXTURES, tmp_path)
    assert set(got) == {"serve", "kv_pool", "decode", "host", "replicas"}
    for name, path in got.items():
        assert path == tmp_path / f"{name}.png", (name, path)
        assert _is_png(path), name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.png" for n in got)


def test_the_cli_writes_beside_the_results_and_names_each_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("serve.json", "replicas.json"):
        shutil.copy(FIXTURES / name, tmp_path / name)
    assert main(["plot", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"serve: {tmp_path / 'serve.png'}" in out
    assert f"replicas: {tmp_path / 'replicas.png'}" in out
    assert _is_png(tmp_path / "serve.png") and _is_png(tmp_path / "replicas.png")
    # the host-path benchmark (issue 41) has not run: its plot is skipped with a note
    assert any(x.startswith("host: skipped: host.json not found") for x in out)
    assert any(x.startswith("decode: skipped: real_shapes.json") for x in out)
    assert any(x.startswith("kv_pool: skipped: no kv_tiers") for x in out)
    assert not (tmp_path / "host.png").exists()


def test_nothing_to_draw_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "png")]) == 1
    assert "host: skipped" in capsys.readouterr().out
    assert not list((tmp_path / "png").iterdir())
    assert main(["plot", str(tmp_path / "missing")]) == 1
    assert "no such results folder" in capsys.readouterr().out


def test_host_plot_reads_the_documented_shape(tmp_path: Path) -> None:
    (tmp_path / "host.json").write_text(json.dumps(plot.HOST_SHAPE), encoding="utf-8")
    assert plot.host(tmp_path, tmp_path) == tmp_path / "host.png"
    assert _is_png(tmp_path / "host.png")
    # a run without "ratio" gets it from the two tokens/s; none at all: skipped, no crash
    (tmp_path / "host.json").write_text(json.dumps({"runs": []}), encoding="utf-8")
    assert plot.host(tmp_path, tmp_path) == "host.json has no runs"


def test_the_published_results_draw_every_plot_but_host(tmp_path: Path) -> None:
    """The committed results behind benchmarks/plots/*.png still draw (so the README's
    pictures can be made again from them)."""
    published = Path(plot.__file__).parent / "results" / "published"
    got = plot.plot_all(published, tmp_path)
    assert {n for n, g in got.items() if isinstance(g, Path)} == {
        "serve",
        "kv_pool",
        "decode",
        "replicas",
    }
    assert isinstance(got["host"], str) and "issue 41" in got["host"]
    for name in ("serve", "kv_pool", "decode", "replicas"):
        assert (Path(plot.__file__).parent / "plots" / f"{name}.png").is_file(), name
