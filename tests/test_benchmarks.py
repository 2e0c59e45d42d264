"""The benchmark tool's behaviour (benchmarks/): workloads, the offline optimum, the report's
arithmetic, the cost bound's totals and the in-process runner. Timings on a shared machine
mean nothing, so nothing here asserts a speed."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from benchmarks import report, workloads
from benchmarks.__main__ import main
from benchmarks.cost_bound import share_costs, totals
from benchmarks.in_process import MMServeRunner, cache_on_off, spread


def _naive_trie_nodes(seqs: list[list[int]]) -> int:
    root: dict = {}
    nodes = 0
    for s in seqs:
        node = root
        for tok in s:
            if tok not in node:
                node[tok] = {}
                nodes += 1
            node = node[tok]
    return nodes


def test_offline_optimum_hand_made() -> None:
    # trie: 1-2-3, 1-2-4, 5-6 (the second [1, 2, 3] and the prefix [1, 2] add nothing)
    got = workloads.optimal_hit_rate([[1, 2, 3], [1, 2, 4], [1, 2, 3], [5, 6], [1, 2]])
    assert (got["total_tokens"], got["distinct_tokens"]) == (13, 6)
    assert got["optimal_hit_rate"] == pytest.approx(1 - 6 / 13)
    assert workloads.optimal_hit_rate([])["optimal_hit_rate"] == 0.0
    img = list(range(-1, -577, -1))  # a shared image run counts once
    assert workloads.trie_size([[1, *img, 7], [1, *img, 8]]) == 1 + 576 + 2


def test_trie_size_matches_naive_trie() -> None:
    rnd = random.Random(0)
    for _ in range(50):
        seqs = [[rnd.randint(-3, 3) for _ in range(rnd.randint(0, 12))] for _ in range(8)]
        assert workloads.trie_size(seqs) == _naive_trie_nodes(seqs)


def _pixels(data: bytes) -> bytes:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).tobytes()


def test_workloads_are_deterministic_per_seed() -> None:
    for name in workloads.HTTP_WORKLOADS:
        scale = workloads.SCALES["http"]["quick"]
        a, b = workloads.build(name, scale, seed=3), workloads.build(name, scale, seed=3)
        assert [p.messages for p in a.prompts] == [p.messages for p in b.prompts], name
        assert a.images == b.images and a.sessions == b.sessions, name
    one = workloads.many_questions(3, 4, 2, seed=1).prompts
    other = workloads.many_questions(3, 4, 2, seed=2).prompts
    assert [p.messages for p in one] != [p.messages for p in other]
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.build("llava_bench", workloads.SCALES["engine"]["ci"])


def test_photos_are_distinct_pixels_past_the_samples() -> None:
    imgs = workloads.photos(16)  # rotating a mirror twice would repeat the originals
    assert len({_pixels(b) for b in imgs.values()}) == 16
    assert imgs["cat.png"] == (workloads.SAMPLES_DIR / "cat.png").read_bytes()


def test_workload_shapes() -> None:
    lb = workloads.build("llava_bench", {"llava_bench": (3, 2.5), "max_tokens": 2})
    per_image = [sum(p.images == [n] for p in lb.prompts) for n in lb.images]
    assert per_image == [3, 3, 2]  # round(3 * 2.5) = 8, spread as evenly as possible
    mt = workloads.multi_turn(2, 3, 4)
    assert [len(r) for r in mt.rounds] == [2, 2, 2]
    assert sorted(i for s in mt.sessions for i in s) == list(range(6))
    for s in mt.sessions:
        turns = [mt.prompts[i] for i in s]
        assert [i // 2 for i in s] == [0, 1, 2] and len({p.images[0] for p in turns}) == 1
        for a, b in zip(turns, turns[1:], strict=False):  # history grows by one exchange
            assert b.messages[: len(a.messages)] == a.messages
            assert [m["role"] for m in b.messages[len(a.messages) :]] == ["assistant", "user"]
    frames = workloads.pan_frames(6, repeat_every=3)
    assert frames[2] == frames[1] and frames[5] == frames[4] and len(set(frames)) == 4
    mixed = workloads.interleaved(3, 3, 2, 3, 4)
    assert sorted(i for s in mixed.sessions for i in s) == list(range(mixed.num_requests))
    chats = [s for s in mixed.sessions if len(s) > 1]
    asked = {n for s in mixed.sessions if len(s) == 1 for n in mixed.prompts[s[0]].images}
    chatted = {n for s in chats for i in s for n in mixed.prompts[i].images}
    assert len(chats) == 2 and len(asked) == 3 and len(chatted) == 2 and not asked & chatted


def test_openai_messages_put_urls_in_image_order() -> None:
    p = workloads.Prompt(
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}],
            }
        ],
        ["b", "a"],
    )
    parts = workloads.openai_messages(p, {"a": "data:A", "b": "id-b"})[0]["content"]
    assert [x.get("image_url", {}).get("url") for x in parts] == ["id-b", None, "data:A"]
    assert workloads.data_url(b"\x89PNG....").startswith("data:image/png;base64,")


def test_percentiles_interpolate_linearly() -> None:
    got = report.percentiles([4.0, 1.0, 3.0, 2.0])  # unsorted on purpose
    assert got == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97})
    assert report.percentiles([])["p50"] is None
    assert spread(10, 3) == [0, 4, 9] and spread(3, None) == [0, 1, 2]


def _system(name: str, rps: float, cpu_rps: float, hit: float = 0.0, **kw: object) -> dict:
    return dict(
        system=name,
        requests_per_s=rps,
        requests_per_cpu_s=cpu_rps,
        cache_hit_rate=hit,
        pool_tokens=100,
        **kw,
    )


def test_targets_from_known_figures() -> None:
    mq = {
        "prompts": {"optimal_hit_rate": 0.8},
        "systems": [
            _system("transformers", 1.0, 2.0),
            _system("mmserve-off", 2.0, 2.0),
            _system("mmserve-lpm", 7.0, 5.0, hit=0.78),
        ],
    }
    ns = {
        "systems": [
            _system("mmserve-off", 2.0, 2.0),
            _system("mmserve-lpm", 1.0, 1.0, tree_fraction=0.01, tree_seconds=0.1),
        ],
        "paired_on_off": {"wall_ratios": [0.9, 1.0, 1.2], "cpu_ratios": [1.0, 1.0, 0.5]},
    }
    got = {
        t["target"]: t
        for t in report.engine_targets({"many_questions": mq, "no_sharing": ns}, {}, "lpm")
    }
    vs_hf = got["many_questions: cache-on req/s vs transformers (wall time)"]
    assert vs_hf["value"] == pytest.approx(7.0) and vs_hf["met"] is True
    assert got["many_questions: cache-on req/s vs transformers (CPU time)"]["met"] is False  # 2.5
    assert got["many_questions: cache-on req/s vs mmserve-off (wall time)"]["value"] == 3.5
    hit = got["many_questions (mmserve-lpm): hit rate / offline optimum"]
    assert hit["value"] == pytest.approx(0.975) and hit["met"] is False  # needs 0.98
    assert got["no_sharing: radix-tree time / wall time"]["met"] is False  # 1 % > 0.3 %
    wall = got["no_sharing: cache-on / cache-off throughput (wall time)"]
    assert wall["value"] == 1.0 and wall["met"] is True  # median of the pairs, not the runs' 0.5


def test_http_achieved_over_bound() -> None:
    res = {
        "workloads": {
            "w": {
                "bound": {"bound_s": 1.0, "bound_cpu_s": 0.5},
                "runs": {
                    "mmserve": {
                        "1": {"duration_s": 9.0, "server_cpu_s": 9.0},
                        "burst": {"duration_s": 2.0, "server_cpu_s": 1.0},
                    }
                },
            }
        }
    }
    assert report.achieved(res, "w", "mmserve") == {"wall": 0.5, "cpu": 0.5, "rate": "burst"}
    got = report.http_targets(res, "w", 0.95, 8)
    assert [t["met"] for t in got] == [False, False]


def test_cost_bound_totals_and_shared_costs() -> None:
    # 100 of 400 prompt tokens and 2 of 8 images distinct, 10 decode steps
    counts = dict(distinct_prompt_tokens=100, prompt_tokens=400, distinct_images=2, images=8)
    a = {**counts, "decode_steps": 10, "decode_step_s": 0.1, "decode_step_cpu_s": 0.1}
    a.update(prefill_s_per_token=0.01, prefill_cpu_s_per_token=0.02)
    a.update(tower_s_per_image=0.5, tower_cpu_s_per_image=0.5)
    totals(a)
    assert a["bound_s"] == pytest.approx(1.0 + 1.0 + 1.0)
    assert a["bound_cpu_s"] == pytest.approx(2.0 + 1.0 + 1.0)
    assert a["max_speedup_from_reuse"] == pytest.approx((4.0 + 4.0 + 1.0) / 3.0)
    b = {**a, "prefill_s_per_token": 0.005, "tower_s_per_image": 0.9}
    share_costs([a, b])
    assert a["prefill_s_per_token"] == b["prefill_s_per_token"] == 0.005
    assert a["tower_s_per_image"] == b["tower_s_per_image"] == 0.5
    assert b["own_tower_s_per_image"] == 0.9 and b["bound_s"] == pytest.approx(0.5 + 1.0 + 1.0)


def test_closed_loop_equals_lock_step_and_arrivals(loaded, model_dir: Path) -> None:
    mm = MMServeRunner(loaded, str(model_dir))
    wl = workloads.multi_turn(3, 3, 2)
    closed = mm.run(wl, "closed")
    lock = mm.run(wl, "lock", closed_loop=False)
    timed = mm.run(wl, "timed", arrivals=[0.01 * i for i in range(wl.num_requests)])
    for r in (closed, lock, timed):
        assert r.all_finished and r.leak_free and len(r.outputs) == wl.num_requests
        assert r.steps["prefill"] >= 1 and r.steps["decode"] >= 1
    assert closed.outputs == lock.outputs == timed.outputs  # same prompts, greedy
    # a turn's history is cached when it arrives after its previous answer
    assert closed.cached_tokens > 0 and closed.summary()["cache_hit_rate"] > 0.5


def test_cache_on_off_counts_reuse(model_dir: Path, capsys) -> None:
    k, m = 2, 3
    got = cache_on_off(str(model_dir), workloads.many_questions(k, m, 2))
    on, off = got["on"], got["off"]
    assert on["requests"] == off["requests"] == k * m and on["output_tokens"] == k * m * 2
    assert on["vision_tower_runs"] == k and on["image_prefills"] == k
    assert off["image_prefills"] == k * m and off["cache_hit_rate"] == 0.0
    assert 0 < on["cache_hit_rate"] < 1
    assert got["ratio"]["image_prefills"] == pytest.approx(1 / m)
    assert "image_prefills" in capsys.readouterr().out


def test_run_suite_ci(tmp_path: Path, model_dir: Path) -> None:
    out = tmp_path / "results"
    argv = ["run", "--scale", "ci", "--model", str(model_dir), "--out", str(out)]
    assert main([*argv, "--policies", "lpm,fcfs", "--baseline-max", "1"]) == 0
    for name in workloads.ENGINE_WORKLOADS:
        res = json.loads((out / f"{name}.json").read_text())
        systems = {s["system"]: s for s in res["systems"]}
        assert {"transformers", "mmserve-off", "mmserve-lpm", "mmserve-fcfs"} <= set(systems)
        assert systems["mmserve-off"]["cache_hit_rate"] == 0.0
        for label, cmp in res["comparisons"].items():  # caches never change greedy tokens
            assert cmp.get("mismatches_vs_off", 0) == 0, (name, label)
        assert all(s["leak_free"] for s in systems.values() if s["kind"] == "mmserve")
    sweeps = json.loads((out / "pool_sweep.json").read_text())
    for sweep in sweeps.values():
        pools = [p["pool_tokens"] for p in sweep["points"]]
        assert (max(pools), min(pools)) == (
            sweep["working_set_tokens"],
            sweep["one_request_tokens"],
        )
        assert all(p["all_finished"] and p["output_mismatches"] == 0 for p in sweep["points"])
    targets = json.loads((out / "summary.json").read_text())["targets"]
    names = [t["target"] for t in targets]
    assert "multi_turn (mmserve-lpm-halfpool): hit rate / offline optimum" in names
    summary = (out / "summary.md").read_text()
    assert "## Targets" in summary and "| mmserve-fcfs-halfpool |" in summary


def test_batch_api_benchmark_tiny(model_dir: Path, tmp_path: Path) -> None:
    argv = ["batch-api", "--model", str(model_dir), "--images", "3", "--questions", "2"]
    argv += ["--probes", "2", "--ttft-scale", "1", "--probe-period", "0.05", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = json.loads((tmp_path / "batch_api.json").read_text())
    a, b, c = out["batch"], out["burst"], out["ttft"]
    assert a["requests"] == b["requests"] == 6
    # the pool holds every photo: the batch reaches the optimum, one tower run per photo
    assert a["hit_rate"] == pytest.approx(out["optimum"], rel=0.02) and 0 < out["optimum"] < 1
    assert a["tower_runs"] == 3 and b["tower_runs"] >= 3
    assert c["during_n"] >= 1 and c["ratio"] == pytest.approx(c["during_p50"] / c["idle_p50"])


def test_tracing_benchmark_tiny(model_dir: Path, tmp_path: Path) -> None:
    argv = ["tracing", "--model", str(model_dir), "--scale", "ci", "--repeats", "2"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "tracing_overhead.json").read_text())
    assert len(out["req_s_ratios"]) == 2 and out["req_s_on_over_off"] > 0
    assert set(out["rows"]) == {"off", "on"} and out["rows"]["on"]["cpu_ms"] > 0
    # every chat request's spans reached the sink: server, endpoint, preprocess, request,
    # queue, prefill, decode at least (the rest: warm-up, flushes, vision tower)
    assert out["spans_per_request"] >= 7 and out["export_bytes_per_request"] > 0


def test_kv_tiers_benchmark_tiny(model_dir: Path, tmp_path: Path) -> None:
    argv = ["kv-tiers", "--model", str(model_dir), "--images", "3", "--questions", "2"]
    argv += ["--max-tokens", "2", "--ttft-images", "2", "--no-cold", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = json.loads((tmp_path / "kv_tiers.json").read_text())
    opt = out["optimum"]["cache_hit_rate"]
    assert out["host"]["cache_hit_rate"] == out["disk"]["cache_hit_rate"] == opt
    assert opt > out["off"]["cache_hit_rate"]
    assert out["disk"]["tier_disk_hit_tokens"] > 0 and out["host"]["tier_host_hit_tokens"] > 0
    assert out["restart"]["vision_tower_runs"] == 0 and out["restart"]["feature_loads"] == 3
    assert out["restart"]["image_tokens_cached_share"] >= 0.95
    t = out["ttft"]
    assert t["first_tokens_equal"] and t["disk_tower_runs"] == 0 and t["recompute_tower_runs"] == 2
    assert t["disk_feature_loads"] == 2 and t["disk_hit_tokens"] >= 2 * 560


def test_salt_benchmark_tiny(model_dir: Path, tmp_path: Path) -> None:
    argv = ["salt", "--model", str(model_dir), "--rounds", "2", "--images", "2"]
    assert main([*argv, "--questions", "2", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "salt.json").read_text())
    rows = out["rows"]
    assert rows["other tenant's image"]["cached_tokens"] == 0
    assert rows["other tenant's image"]["tower_runs"] == 1
    assert rows["own image"]["cached_tokens"] == rows["own image"]["prompt_tokens"] - 1
    assert out["hit_rate"]["no salt"] == out["hit_rate"]["one salt"] > 0


def test_model_identity_benchmark_tiny(model_dir: Path, tmp_path: Path) -> None:
    argv = ["model-identity", "--model", str(model_dir), "--repeats", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = json.loads((tmp_path / "model_identity.json").read_text())
    total = out["cold"]["bytes_total"]
    assert total > (model_dir / "model.safetensors").stat().st_size
    assert out["cold"]["bytes_read"] == out["warm"]["bytes_read"] == total
    assert out["memo"]["bytes_read"] == 0 and out["memo"]["memo_hits"] == out["memo"]["files"]
    assert out["cold"]["digest"] == out["memo"]["digest"]


def test_video_budget_benchmark_tiny(families, tmp_path: Path) -> None:
    ov = families["llava-onevision"]
    per = ov.loaded.family.video_frame_tokens()
    cap = 12 * per + 1  # room for 12 frames
    argv = ["video-budget", "--model", str(ov.model_dir), "--seconds", "3"]
    assert main([*argv, "--max-video-tokens", str(cap), "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "video_budget.json").read_text())
    rows = out["rows"]
    assert out["per_frame"] == per and out["info"]["num_frames"] == 30
    assert all(r["within"] and r["video_tokens"] == r["frames"] * per + 1 for r in rows.values())
    assert {k: r["frames"] for k, r in rows.items()} == {
        "default (8 frames)": 8,
        "fps=1": 3,
        "fps=2": 6,
        "fps=10": 12,  # 30 asked, thinned to the budget
        "fps=10, max_frames=16": 12,
        f"fps=10, max_video_tokens={cap // 4}": 2,  # 48 tokens: 2 frames and the newline
    }
    assert out["exact_over"]["status"] == 400
    assert out["exact_over"]["error"]["param"] == "num_frames"


def test_video_followup_benchmark_tiny(families, tmp_path: Path) -> None:
    nv = families["llava-next-video"]
    argv = ["video-followup", "--model", str(nv.model_dir), "--rounds", "1"]
    assert main([*argv, "--num-frames", "3", "--max-tokens", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "video_followup.json").read_text())["rows"]
    first, second = rows["llava-next-video first"], rows["llava-next-video second"]
    assert first["per_frame"] == 16 and first["tower_runs"] == 3 and first["cached_tokens"] == 0
    # the second question: no tower run, the prompt up to its text cached (page size 1)
    assert second["tower_runs"] == 0
    assert 3 * 16 < second["cached_tokens"] < second["prompt_tokens"]
    assert second["ttft_ratio"] == second["ttft_ms"] / first["ttft_ms"]


def test_live_video_benchmark_tiny(families, tmp_path: Path) -> None:
    ov = families["llava-onevision"]
    per = ov.loaded.family.video_frame_tokens()
    argv = ["live-video", "--model", str(ov.model_dir), "--scale", "ci", "--dtype", "float32"]
    argv += ["--idle-seconds", "0.5"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "live_video.json").read_text())
    rows = out["rows"]
    assert [r["t"] for r in rows.values()] == [4, 8, 12]  # 12 frames, a question every 4 s
    for r in rows.values():
        assert r["frames"] == r["t"] and r["thinned"] == 0
        # the stream's prompt is the clip's; the frames were prefilled before the question
        assert r["stream_prompt"] == r["clip_prompt"] > r["frames"] * per
        assert r["stream_cached"] >= r["frames"] * per
        assert r["stream_ttft_s"] > 0 and r["clip_ttft_s"] > 0
    # greedy: the stream answers as the clip does
    assert out["summary"]["same_answers"] == out["summary"]["questions"] == 3
    assert out["summary"]["stream_late_over_early"] > 0
    assert out["summary"]["raw_cpu_s_per_frame"] > 0 and out["summary"]["idle_cpu_s_per_s"] >= 0
    assert out["meta"]["dtype"] == "float32" and out["meta"]["load"]
    ramp = out["ramp"]
    assert ramp and ramp[0]["rate"] == 2.0 and ramp[0]["sent"] == 4
    # fps = the rate: nothing thinned; 16 frames at 8/s roll the 12-frame window
    assert all(r["thinned"] == 0 and 0 < r["held"] == min(r["sent"], 12) for r in ramp[:1])
    assert all(r["thinned"] == 0 and 0 < r["held"] <= 12 for r in ramp)
    assert out["summary"]["sustained_fps"] in (None, 2.0, 8.0)


def test_decode_weight_bytes_counts_a_tied_head_once() -> None:
    from benchmarks.real_shapes import decode_weight_bytes

    dec = torch.nn.Module()
    dec.embed_tokens = torch.nn.Embedding(10, 4)  # 40 fp32 = 160 bytes
    dec.lm_head = torch.nn.Linear(4, 10, bias=False)  # 160 bytes, read every step
    dec.layer = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)  # 32 bytes
    assert decode_weight_bytes(dec) == 160 + 32  # untied: the table is not read whole
    dec.lm_head.weight = dec.embed_tokens.weight
    assert decode_weight_bytes(dec) == 160 + 32  # tied: one tensor, read once


def test_real_shapes_tiny(families, tmp_path: Path) -> None:
    from mmserve.config import auto_dtype
    from mmserve.model.loader import load_model

    ov = families["llava-onevision"].model_dir
    argv = ["real-shapes", "--model", str(ov), "--dtypes", "float32", "--repeats", "1"]
    argv += ["--tokens", "3", "--batch", "2", "--decode-batches", "1,3", "--decode-tokens", "2"]
    assert main([*argv, "--bandwidth-gb", "0.01", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "real_shapes.json").read_text())
    r = data["results"]["float32"]
    assert r["batch"] == 2 and r["prompt_tokens"] > 100
    assert all(r[k] > 0 for k in ("hf_first", "mm_first", "mm_second", "hf_decode", "mm_decode"))
    assert r["mm_second"] < r["mm_first"]  # the photo's prefix is cached
    assert "| 2 concurrent answers vs batch 1 (tokens/s), float32 |" in data["table"]
    (sw,) = data["decode"]
    dec = load_model(ov).decoder
    assert sw["weight_bytes"] == sum(p.numel() * 4 for p in dec.parameters()) - (
        0 if dec.shape.tie_word_embeddings else dec.embed_tokens.weight.numel() * 4
    )
    assert sw["bound_ms"] == pytest.approx(sw["weight_bytes"] / (sw["bandwidth_gbs"] * 1e6))
    assert sw["bound_cpu_ms"] == pytest.approx(sw["weight_bytes"] / (sw["bandwidth_cpu_gbs"] * 1e6))
    assert set(sw["batches"]) == {"1", "3"}
    for b in sw["batches"].values():
        assert set(b) == {"mm", "mm_cpu", "hf", "hf_cpu"} and all(v > 0 for v in b.values())
    d = sw["default"]
    assert d["dtype"] == auto_dtype("cpu")[0] and d["ms"] > 0 and d["explicit_ms"] > 0
    assert "| float32, batch 3 |" in data["table"] and "default server dtype" in data["table"]


def test_interleaved_workload_and_table_writer() -> None:
    wl = workloads.interleaved(k=3, m=3, c=2, t=3, max_tokens=4)
    assert wl.num_requests == 3 * 3 + 2 * 3
    for turns in (s for s in wl.sessions if len(s) > 1):  # turn t holds the history of turns < t
        assert [len(wl.prompts[i].messages) for i in turns] == [2, 4, 6]
    rows = {"a": {"x": 0.5, "t": {"p50": 0.0123}, "ok": True}, "b": {"x": 2, "ok": False}}
    md = report.table(rows, "row|x=x:.3f|TTFT ms=t.p50:ms|ok=ok|missing=nope")
    assert md.splitlines()[0] == "| row | x | TTFT ms | ok | missing |"
    assert md.splitlines()[2:] == ["| a | 0.500 | 12 | yes | - |", "| b | 2 | - | NO | - |"]


def test_each_subcommand_keeps_its_own_checkpoint_defaults() -> None:
    from benchmarks.__main__ import parser

    names = ("replicas", "real-shapes", "video-qa", "video-budget", "video-followup", "serve")
    got = {c: parser().parse_args([c]) for c in names}
    assert {c: (a.size, a.family) for c, a in got.items()} == {
        "replicas": ("tiny", "llava"),
        "real-shapes": ("onevision-0.5b", "llava-onevision"),
        "video-qa": ("small", "llava"),
        "video-budget": ("small", "llava-onevision"),
        "video-followup": ("small", "llava-next-video"),
        "serve": (None, "llava"),
    }


def test_server_retries_when_its_port_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import sys

    from benchmarks import over_http

    # a tiny server that answers /health on the --port it is given, or dies on a taken one
    code = (
        "import sys, http.server\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        "try:\n"
        "    s = http.server.HTTPServer(('127.0.0.1', int(sys.argv[-1])), H)\n"
        "except OSError as e:\n"
        "    print(e, file=sys.stderr); sys.exit(1)\n"
        "s.serve_forever()\n"
    )
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1], over_http.free_port()])
    monkeypatch.setattr(over_http, "free_port", lambda: next(ports))
    try:
        with over_http.server([sys.executable, "-c", code], {}, timeout=30) as (url, proc):
            assert url != f"http://127.0.0.1:{taken.getsockname()[1]}"
            assert proc.poll() is None
        assert proc.poll() is not None
    finally:
        taken.close()


def test_image_detail_reports_fewer_tokens_for_low(tmp_path: Path) -> None:
    from benchmarks.__main__ import main

    argv = ["image-detail", "--size", "tiny", "--scale", "ci", "--repeats", "1"]
    assert main([*argv, "--out", str(tmp_path), "--photo", "300x200"]) == 0
    rows = json.loads((tmp_path / "image_detail.json").read_text())
    assert rows["photo"] == "300x200"
    for family in ("llava-onevision", "llava-next"):
        high, low = rows[f"{family} high"], rows[f"{family} low"]
        assert low["image_tokens"] < high["image_tokens"]
        assert high["prompt_tokens"] - low["prompt_tokens"] == (
            high["image_tokens"] - low["image_tokens"]
        )
        assert low["ttft_s"] > 0 and high["ttft_ratio_vs_high"] == 1.0


def test_graph_decode_tiny(model_dir: Path, tmp_path: Path) -> None:
    from benchmarks import graph_decode

    argv = ["--model", str(model_dir), "--out", str(tmp_path), "--batches", "1,3"]
    argv += ["--tokens", "3", "--images", "1", "--questions", "2", "--profile-tokens", "2"]
    assert graph_decode.main(argv) == 0
    res = json.loads((tmp_path / "graph_decode.json").read_text())
    rows = res["rates"]["configs"]
    assert set(rows) == {"eager", "padded twin"}
    for row in rows.values():
        assert row["tokens_equal"] == {"1": 1, "3": 3}  # the twin's tokens are eager's
        assert row["bs1_tok_s"] > 0 and row["bs3_tok_s"] > 0 and row["captured"] == []
    for prof in res["profile"].values():
        assert prof["steps"] >= 2 and 0 <= prof["host_share"] < 1
        assert prof["model_ms"] > 0 and prof["step_ms"] >= prof["model_ms"]


def test_hub_load_benchmark_tiny(model_dir: Path, tmp_path: Path) -> None:
    argv = ["hub-load", "--model", str(model_dir), "--repeats", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = json.loads((tmp_path / "hub_load.json").read_text())
    assert len(out["seconds"]["path"]) == len(out["seconds"]["hub_id"]) == 2
    assert 0 < out["median_s"]["resolve"] < out["median_s"]["hub_id"]
    assert out["ratio_hub_over_path"] > 0


def test_spec_benchmark_tiny(model_dir: Path, tmp_path: Path) -> None:
    """``spec``: the quoting checkpoint's drafts are kept (fewer decode steps, accepted
    length > 1), the reversed one's never are; every configuration is there."""
    from benchmarks.__main__ import main

    argv = ["spec", "--model", str(model_dir), "--out", str(tmp_path), "--rounds", "1"]
    assert main([*argv, "--tokens", "12", "--batches", "1,2"]) == 0
    res = json.loads((tmp_path / "spec.json").read_text())
    rows = {(r["model"], r["batch"], r["config"]): r for r in res["rows"]}
    assert set(rows) == {
        (m, b, c)
        for m in ("quoting", "rejected", "random")
        for b in (1, 2)
        for c in ("off", "on", "forced")
    }
    on, off = rows[("quoting", 1, "on")], rows[("quoting", 1, "off")]
    assert on["accepted_length"] > 1 and on["steps_per_round"] < off["steps_per_round"]
    assert off["accepted_length"] is None and all(r["tok_s"] > 0 for r in rows.values())
    worst = rows[("rejected", 1, "forced")]  # drafts always found, never kept
    assert worst["accepted_length"] == 1.0 and worst["kept_share"] == 0.0


def test_host_benchmark_tiny(model_dir: Path, tmp_path: Path) -> None:
    from benchmarks.plot import HOST_SHAPE

    argv = ["host", "--model", str(model_dir), "--scale", "ci", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = json.loads((tmp_path / "host.json").read_text())
    assert set(HOST_SHAPE["meta"]) <= set(out["meta"])
    runs = out["runs"]
    assert {(r["concurrency"], r["mode"]) for r in runs} == {(4, "streamed"), (4, "plain")}
    for r in runs:
        assert set(HOST_SHAPE["runs"][0]) <= set(r)
        assert r["ratio"] > 0 and r["server_tokens_per_s"] > 0 and r["engine_tokens_per_s"] > 0
        # today one server process: all its CPU is the API process's
        assert r["server_processes"] >= 1 and r["api_cpu_us_per_token"] > 0
        assert r["engine_host_us_per_token"] > 0
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "host.png").stat().st_size > 0


def test_image_repeat_benchmark_tiny(model_dir: Path, tmp_path: Path) -> None:
    argv = ["image-repeat", "--model", str(model_dir), "--scale", "ci", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = json.loads((tmp_path / "image_repeat.json").read_text())
    assert set(out["rows"]) == {"this checkout, data URL", "this checkout, image id"}
    for row in out["rows"].values():
        assert row["api_cpu_ms"] > 0 and row["engine_cpu_ms"] > 0 and row["wall_ms"] > 0
    assert out["tower_runs"] == {"this checkout": 1}  # the warm-up's only


def test_engine_process_benchmark_tiny(model_dir: Path, tmp_path: Path) -> None:
    argv = ["engine-process", "--model", str(model_dir), "--scale", "ci", "--rounds", "2"]
    argv += ["--ttft-probes", "2", "--concurrency", "4", "--tokens", "4", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = json.loads((tmp_path / "engine_process.json").read_text())
    assert set(out["rows"]) == {"split", "in_process"}
    for row in out["rows"].values():
        assert row["ttft_ms"] > 0 and row["tokens_per_s"] > 0
        assert row["many_questions_req_s"] > 0
    # many_questions (1 photo x 2 questions at the ci scale), every round on both servers
    assert "1 images x 2 questions" in out["many_questions"]
    rps = out["many_questions_req_s"]
    assert len(rps["split"]) == len(rps["in_process"]) == 2
    ratios = sorted(a / b for a, b in zip(rps["split"], rps["in_process"], strict=True))
    assert out["many_questions_split_over_in_process"] == pytest.approx(sum(ratios) / 2)
    assert out["ratios"]["split / in-process"]["ttft"] == out["ttft_split_over_in_process"]


def test_host_benchmark_counts_a_servers_child_processes() -> None:
    import os
    import subprocess
    import sys

    from benchmarks.host import cpu_by_process, process_tree

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in process_tree(os.getpid())
        cpu = cpu_by_process(os.getpid())
        assert os.getpid() in cpu and child.pid in cpu and cpu[os.getpid()] > 0
    finally:
        child.kill()
        child.wait()


def test_conversation_benchmark_tiny(model_dir: Path, tmp_path: Path) -> None:
    argv = ["conversation", "--model", str(model_dir), "--rounds", "1", "--max-tokens", "2"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "conversation.json").read_text())
    two, three = out["turns"]
    # the chain's later turns find every earlier turn, the photo included, in the cache
    assert two["cached_tokens"] >= 576 and three["cached_tokens"] > two["cached_tokens"]
    assert three["input_tokens"] > two["input_tokens"]
    assert two["ratio_chain_over_resend"] > 0 and len(out["raw"]["resend"]) == 1


def test_output_benchmark_round(model_dir: Path) -> None:
    """One in-process round of ``output`` (the worker's): every token of every request
    reaches the answer, streamed and plain, with and without a stop string."""
    import asyncio

    from benchmarks import output

    for _case, streamed, stop in output.CASES:
        got = asyncio.run(output._one_round(str(model_dir), 4, 12, streamed, stop))
        assert got["us_per_token"] > 0 and got["chars"] > 4 * 12


def test_determinism_benchmark_tiny(families, tmp_path: Path) -> None:
    """``determinism``: one answer with the mode on; decode timed off and on at batch 1 and
    8 over a cached text context, the dtype named."""
    ov = families["llava-onevision"].model_dir
    argv = ["determinism", "--model", str(families["llava"].model_dir), "--out", str(tmp_path)]
    argv += ["--dtype", "bfloat16", "--parts", "answers,decode", "--repeats", "1"]
    argv += ["--decode-model", str(ov), "--decode-tokens", "3", "--decode-context", "40"]
    assert main(argv) == 0
    res = json.loads((tmp_path / "determinism.json").read_text())
    assert res["dtype"] == res["decode_dtype"] == "bfloat16"
    assert res["distinct_answers"]["on"] == 1
    for batch in ("batch1", "batch8"):
        row = res["decode_ms"][batch]
        assert row["off"] > 0 and row["on"] > 0 and len(row["rounds"]["on"]) == 1
        assert row["on_over_off"] == row["on"] / row["off"]
        assert row["on_over_off_cpu"] == row["on_cpu"] / row["off_cpu"] > 0
    assert res["decode_ms"]["context_tokens"] == 40


def test_export_qwen2_lm_is_the_onevision_language_model(families, tmp_path: Path) -> None:
    """The exported ``Qwen2ForCausalLM`` holds the OneVision checkpoint's decoder bytes: it
    gives transformers' LLaVA-OneVision language model's logits exactly; the byte-level BPE
    tokenizer is named ``gpt-2`` for llama.cpp, a SentencePiece one is not named."""
    from transformers import AutoModelForImageTextToText, Qwen2ForCausalLM

    from benchmarks.llamacpp import byte_level_pre_tokenizer, export_qwen2_lm

    ov = families["llava-onevision"].model_dir
    out = export_qwen2_lm(ov, tmp_path / "lm")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    lm = Qwen2ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    full = AutoModelForImageTextToText.from_pretrained(ov, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 30, 7, 2]])
    with torch.inference_mode():
        want = full(input_ids=ids).logits
        got = lm(input_ids=ids).logits
    assert torch.equal(got, want)
    assert byte_level_pre_tokenizer(out) == "gpt-2"
    assert byte_level_pre_tokenizer(families["llava-next"].model_dir) is None
    with pytest.raises(ValueError, match="expected qwen2"):
        export_qwen2_lm(families["llava"].model_dir, tmp_path / "llama")


def _fake_converter(src: Path) -> None:
    """A stand-in llama.cpp tree: its converter refuses every pre-tokenizer hash (as the real
    one refuses ours) and writes the name it was given into the output file."""
    (src / "conversion").mkdir(parents=True)
    (src / "conversion" / "__init__.py").write_text("")
    (src / "conversion" / "base.py").write_text(
        "class TextModel:\n"
        "    def get_vocab_base_pre(self, tokenizer):\n"
        "        raise NotImplementedError('BPE pre-tokenizer was not recognized')\n"
    )
    (src / "convert_hf_to_gguf.py").write_text(
        "import sys\nfrom conversion.base import TextModel\n"
        "out = sys.argv[sys.argv.index('--outfile') + 1]\n"
        "open(out, 'w').write(TextModel().get_vocab_base_pre(None))\n"
    )


def test_convert_lm_names_only_an_identified_pre_tokenizer(
    families, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The converter's refusal of an unlisted hash is answered with the name read from
    ``tokenizer.json`` (byte-level BPE: ``gpt-2``) and kept for anything else."""
    import sys

    from benchmarks.llamacpp import convert_lm

    src = tmp_path / "src"
    _fake_converter(src)
    for name in ("conversion", "conversion.base"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    ov, sp = families["llava-onevision"].model_dir, families["llava-next"].model_dir
    out = convert_lm(src, ov, tmp_path / "ov.gguf")
    assert out.read_text() == "gpt-2"
    with pytest.raises(NotImplementedError, match="not recognized"):
        convert_lm(src, sp, tmp_path / "sp.gguf")
    for name in ("conversion", "conversion.base"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_llamacpp_decode_tiny(families, tmp_path: Path) -> None:
    """``llamacpp-decode`` against a stand-in ``llama-bench``: each method meets the GGUF of
    its bit width, with the same threads and mmserve's prompt length as the cache depth, in
    every round; the ratio is mmserve's median over llama.cpp's."""
    import sys

    d = tmp_path / "ll"
    (d / "onevision").mkdir(parents=True)
    for q in ("Q4_0", "Q8_0"):
        (d / "onevision" / f"lm-{q}.gguf").write_text(q)
    calls = tmp_path / "calls.jsonl"
    bench = d / "llama-bench"
    bench.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "m = open(sys.argv[sys.argv.index('-m') + 1]).read()\n"
        "ts = {'Q4_0': 40.0, 'Q8_0': 20.0}[m]\n"
        "print(json.dumps([{'n_prompt': 0, 'n_gen': 3, 'avg_ts': ts}]))\n"
    )
    bench.chmod(0o755)
    info = {"bench": "llama-bench", "onevision_gguf": {}}
    info["onevision_gguf"] = {q: f"onevision/lm-{q}.gguf" for q in ("Q4_0", "Q8_0")}
    (d / "setup.json").write_text(json.dumps(info))
    ov = families["llava-onevision"].model_dir
    argv = ["llamacpp-decode", "--model", str(ov), "--llamacpp-dir", str(d), "--rounds", "2"]
    argv += ["--tokens", "3", "--threads", "1", "--bandwidth-gb", "0.01"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "llamacpp_decode.json").read_text())
    seen = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(seen) == 8 and res["depth"] > 5  # per round and type: 3 tokens, then 1
    for a in seen:
        assert a[a.index("-t") + 1] == "1" and a[a.index("-p") + 1] == "0"
        assert a[a.index("-d") + 1] == str(res["depth"])
    assert [a[a.index("-n") + 1] for a in seen] == ["3", "1"] * 4
    names = [Path(a[a.index("-m") + 1]).name for a in seen]
    assert (
        names
        == ["lm-Q4_0.gguf"] * 2 + ["lm-Q8_0.gguf"] * 2 + ["lm-Q4_0.gguf"] * 2 + ["lm-Q8_0.gguf"] * 2
    )
    for m, ts in (("int4", 40.0), ("int8", 20.0)):
        r = res[m]
        assert r["llamacpp_rounds"] == [ts, ts] and len(r["mmserve_rounds"]) == 2
        assert r["ratio"] == pytest.approx(r["mmserve_tokens_per_s"] / ts)
        assert len(r["llamacpp_cpu_rounds"]) == 2 and "llamacpp_tokens_per_cpu_s" in r
        sp = r["split"]  # the step less its quantized matmuls; their bytes and the bound
        assert sp["matmul_cpu_ms"] == pytest.approx(
            sp["step_cpu_ms"] - sp["step_cpu_ms_without_matmuls"]
        )
        assert sp["weight_bytes"] > 0 and sp["bound_cpu_ms"] > 0
    assert res["int4"]["split"]["weight_bytes"] < res["int8"]["split"]["weight_bytes"]
    assert main([*argv[:3], "--llamacpp-dir", str(tmp_path / "none"), "--out", str(tmp_path)]) == 1


def test_spec_as_the_gpu_check_runs_it(model_dir: Path, tmp_path: Path) -> None:
    """``python -m benchmarks.spec`` (no benchmark CLI, as scripts/gpu_check.sh's speculation
    phase runs it) takes every flag of that phase's command line and writes the figures the
    check folds into summary.json: the quoting model's accepted length above 1 at batch 1."""
    import re
    import shlex

    from benchmarks import spec

    script = (Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh").read_text()
    line = re.search(r"-m benchmarks\.spec (.*?)--out", script, re.S)
    assert line is not None
    flags = shlex.split(line.group(1).replace("\\\n", " "))
    assert flags[flags.index("--device") + 1] == "cuda" and "--batches" in flags
    ap_flags = {f for flags_, _ in spec.OPTIONS for f in flags_} | {"--size", "--family"}
    assert {f for f in flags if f.startswith("--")} <= ap_flags
    argv = ["--model", str(model_dir), "--models", "quoting", "--batches", "1", "--tokens", "8"]
    assert spec.main([*argv, "--rounds", "1", "--out", str(tmp_path / "spec")]) == 0
    res = json.loads((tmp_path / "spec" / "spec.json").read_text())
    for key in ("size", "device", "dtype", "prompt_tokens", "tokens", "k", "rounds", "rows"):
        assert key in res
    on = next(r for r in res["rows"] if r["config"] == "on")
    assert on["batch"] == 1 and on["accepted_length"] > 1 and on["speedup"] > 0
