"""The HTTP side of the benchmark tool: the load generator's arithmetic and its runs against a
live tiny server, the ``serve`` suite's outputs, llama.cpp skipped without its setup, and the
profile breakdown."""

from __future__ import annotations

import base64
import cProfile
import json
import math
import pickle
import pstats
import threading
from pathlib import Path

import pytest

from benchmarks import over_http as http
from benchmarks import workloads
from benchmarks.__main__ import main
from benchmarks.llamacpp import find_setup
from benchmarks.profiled_server import breakdown
from tests.live_server import live_server


@pytest.fixture(scope="module")
def server_url(model_dir: Path):
    with live_server(model_dir) as url:
        yield url


def test_arrivals_burst_and_poisson() -> None:
    assert http.arrival_times(5, math.inf) == [0.0] * 5
    a = http.arrival_times(2000, 4.0, seed=1)
    assert a == http.arrival_times(2000, 4.0, seed=1) and a[0] == 0.0
    assert all(x <= y for x, y in zip(a, a[1:], strict=False))
    assert abs(a[-1] / 1999 - 0.25) < 0.025  # mean gap 1 / rate
    with pytest.raises(ValueError):
        http.arrival_times(3, 0.0)


def test_bodies_carry_data_url_images() -> None:
    wl = workloads.build("llava_bench", workloads.SCALES["http"]["ci"])
    bodies = [json.loads(b) for b in http.request_bodies(wl, "m", {"cache_prompt": True})]
    urls = [
        p["image_url"]["url"]
        for b in bodies
        for m in b["messages"]
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "image_url"
    ]
    assert len(urls) == wl.num_requests and all(u.startswith("data:image/") for u in urls)
    b = bodies[0]
    assert b["stream"] and b["ignore_eos"] and b["stream_options"]["include_usage"]
    assert (b["max_tokens"], b["temperature"], b["model"], b["cache_prompt"]) == (
        wl.max_tokens,
        0.0,
        "m",
        True,
    )


def test_summary_figures() -> None:
    rs = [
        http.RequestResult(0, 0.0, sent=0.0, ok=True, ttft=0.5, latency=1.5, completion_tokens=3),
        http.RequestResult(1, 0.0, sent=0.1, ok=True, ttft=3.0, latency=3.2, completion_tokens=3),
        http.RequestResult(2, 0.0, sent=0.2, ok=True, ttft=0.1, latency=0.2, completion_tokens=2),
        http.RequestResult(3, 0.0, sent=0.2, error="HTTP 500", latency=0.1),
    ]
    rs[0].chunk_times = [0.5, 1.0, 1.5]
    s = http.summarize(rs, 3, slo=(1.0, 0.6))
    assert rs[0].tpot == pytest.approx(0.5) and rs[1].tpot == pytest.approx(0.1)
    assert s["duration_s"] == pytest.approx(3.3) and (s["completed"], s["failed"]) == (3, 1)
    assert s["request_throughput"] == pytest.approx(3 / 3.3)
    assert s["good_requests"] == 2 and s["goodput"] == pytest.approx(2 / 3.3)  # 1 late, 3 failed
    assert s["token_counts_ok"] is False and s["wrong_token_counts"] == [2]
    assert s["itl_s"]["p50"] == pytest.approx(0.5) and s["errors"] == ["HTTP 500"]


def test_load_generator_against_live_server(server_url: str) -> None:
    wl = workloads.build("many_questions", workloads.SCALES["http"]["ci"])
    bodies = http.request_bodies(wl, None)
    for rate in (math.inf, 20.0):
        results, wall = http.run_load(server_url, bodies, http.arrival_times(len(bodies), rate))
        s = http.summarize(results, wl.max_tokens, wall=wall)
        assert s["completed"] == wl.num_requests, s["errors"]
        assert s["token_counts_ok"], s["wrong_token_counts"]
        assert s["ttft_s"]["p50"] > 0 and s["tpot_s"]["p50"] > 0 and s["goodput"] > 0
        assert all(r.finish_reason == "length" for r in results)
    # the second answer about the image reuses its prefix
    assert s["cached_tokens"] > 0 and 0 < s["cache_hit_rate"] < 1


def test_closed_loop_clients_wait_for_the_previous_turn(server_url: str) -> None:
    wl = workloads.interleaved(1, 2, 1, 3, 2)
    http.flush(server_url)
    bodies = http.request_bodies(wl, None)
    results, _ = http.run_load(server_url, bodies, sessions=wl.sessions, clients=2)
    assert [r.index for r in results] == list(range(wl.num_requests)) and all(r.ok for r in results)
    chain = next(s for s in wl.sessions if len(s) == 3)
    for a, b in zip(chain, chain[1:], strict=False):
        assert results[b].sent >= results[a].sent + results[a].latency
        assert results[b].cached_tokens > 0  # the history came back cached


def test_serve_suite_against_url(server_url: str, model_dir: Path, tmp_path: Path) -> None:
    rc = main(
        [
            "serve",
            "--scale",
            "ci",
            "--url",
            f"tiny={server_url}",
            "--workloads",
            "many_questions,no_sharing",
            "--rates",
            "inf,50",
            "--model",
            str(model_dir),
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    res = json.loads((tmp_path / "serve.json").read_text())
    for wl in ("many_questions", "no_sharing"):
        runs = res["workloads"][wl]["runs"]["tiny"]
        assert set(runs) == {"burst", "50"} and all(r["token_counts_ok"] for r in runs.values())
    assert "bound" not in res["workloads"]["no_sharing"]  # --url measures no bound by default
    assert "| tiny, burst |" in (tmp_path / "serve.md").read_text()


def test_llamacpp_skipped_with_a_note_without_setup(model_dir: Path, tmp_path: Path) -> None:
    setup, why = find_setup(tmp_path / "none")
    assert setup is None and "setup_llamacpp.sh" in why
    (tmp_path / "half").mkdir()
    names = ("server", "model_gguf", "mmproj_gguf", "hf_dir", "chat_template")
    (tmp_path / "half" / "setup.json").write_text(json.dumps({k: k for k in names}))
    setup, why = find_setup(tmp_path / "half")
    assert setup is None and "incomplete" in why
    out = tmp_path / "out"
    rc = main(
        [
            "serve",
            "--scale",
            "ci",
            "--servers",
            "llamacpp",
            "--llamacpp-dir",
            str(tmp_path / "none"),
            "--workloads",
            "no_sharing",
            "--model",
            str(model_dir),
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    assert "llama.cpp skipped: no llama.cpp setup" in (out / "serve.md").read_text()


def test_profile_breakdown_by_category(tmp_path: Path) -> None:
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
    (tmp_path / "p.pkl").write_bytes(pickle.dumps(stats))
    b = breakdown(tmp_path / "p.pkl")
    assert b["categories_s"]["JSON (parse, dump)"] > 0
    assert b["categories_s"]["base64 / data URL"] > 0
    assert b["largest"] in ("JSON (parse, dump)", "base64 / data URL")
