"""The many-questions benchmark runs on CPU and its figures are consistent."""

from __future__ import annotations

import math

import pytest

from benchmarks import batch_api
from benchmarks.many_questions import format_table, main, sample_images


def test_many_questions_tiny(model_dir, capsys) -> None:  # noqa: ANN001
    k, m, n = 2, 2, 2
    out = main(
        ["--model", str(model_dir), "--images", str(k), "--questions", str(m), "--max-tokens", "2"]
    )
    printed = capsys.readouterr().out
    on, off = out["on"], out["off"]
    for row in ("requests/s", "output tokens/s", "TTFT p50", "cache hit rate", "vision-tower"):
        assert row in printed
    assert "cache on" in printed and "cache off" in printed and "on/off" in printed
    for fig in (on, off):
        assert fig["requests"] == k * m
        assert fig["output_tokens"] == k * m * n  # ignore_eos: exactly max_tokens each
        assert fig["wall_s"] > 0 and fig["requests_per_s"] > 0
        assert math.isclose(fig["output_tokens_per_s"], fig["requests_per_s"] * n)
        assert 0 < fig["ttft_p50_ms"] < 1000 * fig["wall_s"] + 1
    # cache on: later questions reuse the image's KV; off: nothing is reused
    assert 0 < on["cache_hit_rate"] < 1 and off["cache_hit_rate"] == 0
    assert on["vision_tower_runs"] == k and k <= off["vision_tower_runs"] <= k * m
    assert on["image_prefills"] == k and off["image_prefills"] == k * m
    assert out["ratio"]["requests_per_s"] == pytest.approx(
        on["requests_per_s"] / off["requests_per_s"]
    )
    assert out["config"]["attention_backend"] == "torch"


def test_sample_images_are_distinct_past_the_folder() -> None:
    imgs = sample_images(9)
    assert len(imgs) == 9 and len(set(imgs)) == 9
    with pytest.raises(ValueError):
        sample_images(0)


def test_table_without_off_figures_has_no_ratio() -> None:
    from benchmarks.many_questions import Figures

    on = Figures(4, 1.0, 4.0, 8, 8.0, 10.0, 0.5, 2, 2, 2)
    off = Figures(4, 2.0, 2.0, 8, 4.0, 20.0, 0.0, 2, 4, 1)
    table = format_table(on, off)
    assert "2.00x" in table and "cache hit rate" in table
    hit_row = next(line for line in table.splitlines() if line.startswith("cache hit rate"))
    assert hit_row.rstrip().endswith("-")


def test_batch_api_benchmark_tiny(model_dir, capsys) -> None:  # noqa: ANN001
    args = ["--model", str(model_dir), "--images", "3", "--questions", "2", "--probes", "2"]
    out = batch_api.main([*args, "--ttft-scale", "1", "--probe-period", "0.05"])
    printed = capsys.readouterr().out
    assert "/v1/batches" in printed and "chat burst" in printed and "TTFT p50" in printed
    a, b, c = out["batch"], out["burst"], out["ttft"]
    assert a["requests"] == b["requests"] == 6
    # the pool holds every photo: the batch reaches the optimum, one tower run per photo
    assert a["hit_rate"] == pytest.approx(out["optimum"], rel=0.02) and 0 < out["optimum"] < 1
    assert a["tower_runs"] == 3 and b["tower_runs"] >= 3
    assert c["during_n"] >= 1 and c["ratio"] == pytest.approx(c["during_p50"] / c["idle_p50"])
