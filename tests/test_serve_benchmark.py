"""The HTTP serving benchmark (benchmarks.serve): load generator against a live tiny server,
the CLI's outputs, llama.cpp skipped without its setup, the profile breakdown."""

from __future__ import annotations

import cProfile
import json
import math
import pickle
import pstats
import threading
from pathlib import Path

import pytest

from benchmarks import serve, serve_workloads
from benchmarks.http_overhead import breakdown
from benchmarks.llamacpp import find_setup
from benchmarks.loadgen import (
    SLO,
    RequestResult,
    arrival_times,
    openai_messages,
    request_bodies,
    run_load,
    summarize,
)
from tests.live_server import live_server


@pytest.fixture(scope="module")
def server_url(model_dir: Path):  # noqa: ANN201
    with live_server(model_dir) as url:
        yield url


def test_arrivals_burst_and_poisson() -> None:
    assert arrival_times(5, math.inf) == [0.0] * 5
    a = arrival_times(2000, 4.0, seed=1)
    assert a == arrival_times(2000, 4.0, seed=1) and a[0] == 0.0
    assert all(x <= y for x, y in zip(a, a[1:], strict=False))
    assert abs(a[-1] / 1999 - 0.25) < 0.025  # mean gap 1 / rate
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


def test_messages_carry_data_url_images() -> None:
    wl = serve_workloads.build("llava_bench", serve_workloads.SCALES["ci"])
    msgs = openai_messages(wl)
    assert len(msgs) == wl.num_requests
    parts = [p for m in msgs for msg in m for p in msg["content"] if isinstance(p, dict)]
    urls = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
    assert len(urls) == wl.num_requests and all(u.startswith("data:image/") for u in urls)
    body = json.loads(request_bodies(wl, "m")[0])
    assert body["stream"] and body["ignore_eos"] and body["stream_options"]["include_usage"]
    assert body["max_tokens"] == wl.max_tokens and body["temperature"] == 0.0


def test_summary_figures() -> None:
    rs = [
        RequestResult(0, 0.0, sent=0.0, ok=True, ttft=0.5, latency=1.5, completion_tokens=3),
        RequestResult(1, 0.0, sent=0.1, ok=True, ttft=3.0, latency=3.2, completion_tokens=3),
        RequestResult(2, 0.0, sent=0.2, ok=True, ttft=0.1, latency=0.2, completion_tokens=2),
    ]
    rs[0].chunk_times = [0.5, 1.0, 1.5]
    s = summarize(rs, 3, SLO(ttft_s=1.0, tpot_s=0.6))
    assert rs[0].tpot == pytest.approx(0.5) and rs[1].tpot == pytest.approx(0.1)
    assert s["duration_s"] == pytest.approx(3.3) and s["completed"] == 3
    assert s["good_requests"] == 2  # request 1 misses the TTFT bound
    assert s["token_counts_ok"] is False and s["wrong_token_counts"] == [2]
    assert s["itl_s"]["p50"] == pytest.approx(0.5)


def test_load_generator_against_live_server(server_url: str) -> None:
    wl = serve_workloads.build("many_questions", serve_workloads.SCALES["ci"])
    bodies = request_bodies(wl, None)
    for rate in (math.inf, 20.0):
        results, wall = run_load(server_url, bodies, arrival_times(len(bodies), rate, 0))
        s = summarize(results, wl.max_tokens, SLO(60.0, 60.0), wall)
        assert s["completed"] == wl.num_requests, s["errors"]
        assert s["token_counts_ok"], s["wrong_token_counts"]
        assert s["ttft_s"]["p50"] > 0 and s["tpot_s"]["p50"] > 0 and s["goodput"] > 0
        assert s["cached_tokens"] is not None and s["prompt_tokens"] > 0
        assert all(r.finish_reason == "length" for r in results)


def test_cli_against_url_writes_json_and_summary(
    server_url: str, model_dir: Path, tmp_path: Path
) -> None:
    rc = serve.main(
        [
            "--scale", "ci", "--url", f"tiny={server_url}", "--workloads",
            "many_questions,no_sharing", "--rates", "inf,50", "--model", str(model_dir),
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert rc == 0
    res = json.loads((tmp_path / "serve.json").read_text())
    for wl in ("many_questions", "no_sharing"):
        runs = res["workloads"][wl]["runs"]["tiny"]
        assert set(runs) == {"burst", "50"}
        assert all(r["token_counts_ok"] for r in runs.values())
    text = (tmp_path / "serve_summary.md").read_text()
    assert "| tiny | burst |" in text and "TTFT p50" in text


def test_llamacpp_skipped_with_a_note_without_setup(model_dir: Path, tmp_path: Path) -> None:
    setup, why = find_setup(tmp_path / "none")
    assert setup is None and "setup_llamacpp.sh" in why
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "setup.json").write_text(
        json.dumps(
            {
                "server": "build/bin/llama-server",
                "model_gguf": "a.gguf",
                "mmproj_gguf": "b.gguf",
                "hf_dir": "hf",
                "chat_template": "t.jinja",
            }
        )
    )
    setup, why = find_setup(tmp_path / "half")
    assert setup is None and "incomplete" in why
    out = tmp_path / "out"
    rc = serve.main(
        [
            "--scale", "ci", "--servers", "llamacpp", "--llamacpp-dir", str(tmp_path / "none"),
            "--workloads", "no_sharing", "--model", str(model_dir), "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    assert "llama.cpp skipped: no llama.cpp setup" in (out / "serve_summary.md").read_text()


def test_profile_breakdown_by_category(tmp_path: Path) -> None:
    import base64

    stats = {}

    def work() -> None:
        p = cProfile.Profile()
        p.enable()
        for _ in range(200):
            json.loads(json.dumps({"x": list(range(200))}))
            base64.b64decode(base64.b64encode(b"x" * 20000))
        p.disable()
        stats["AnyIO worker thread"] = pstats.Stats(p).stats  # type: ignore[attr-defined]

    t = threading.Thread(target=work)
    t.start()
    t.join()
    path = tmp_path / "p.pkl"
    path.write_bytes(pickle.dumps(stats))
    b = breakdown(path)
    assert b["categories_s"].get("JSON (parse, dump)", 0) > 0
    assert b["categories_s"].get("base64 / data URL", 0) > 0
    assert b["largest"] in ("JSON (parse, dump)", "base64 / data URL")
