"""The benchmark harness (benchmarks/): offline optimum, and a tiny end-to-end run.

These check the harness (files, systems, hit-rate bookkeeping, output equality),
not speed: timings on a shared CI machine mean nothing.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from benchmarks import workloads
from benchmarks.run import MAIN_POLICY, POLICIES, WORKLOADS, main
from benchmarks.systems import MMServeRunner, policy_supported


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
    seqs = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [5, 6], [1, 2]]
    got = workloads.optimal_hit_rate(seqs)
    assert got["total_tokens"] == 13
    assert got["distinct_tokens"] == 6
    assert got["optimal_hit_rate"] == pytest.approx(1 - 6 / 13)
    assert workloads.optimal_hit_rate([])["optimal_hit_rate"] == 0.0
    # image pseudo-ids are negative; a shared image run counts once
    img = list(range(-1, -577, -1))
    two = workloads.optimal_hit_rate([[1, *img, 7], [1, *img, 8]])
    assert two["distinct_tokens"] == 1 + 576 + 2


def test_trie_size_matches_naive_trie() -> None:
    rnd = random.Random(0)
    for _ in range(50):
        seqs = [[rnd.randint(-3, 3) for _ in range(rnd.randint(0, 12))] for _ in range(8)]
        assert workloads.trie_size(seqs) == _naive_trie_nodes(seqs)


def test_workloads_are_seeded_and_shaped() -> None:
    a = workloads.many_questions(2, 3, 4, seed=1)
    b = workloads.many_questions(2, 3, 4, seed=1)
    assert [p.messages for p in a.prompts] == [p.messages for p in b.prompts]
    assert a.num_requests == 6 and len(a.rounds) == 1
    mt = workloads.multi_turn(2, 3, 4)
    assert [len(r) for r in mt.rounds] == [2, 2, 2]
    last = mt.rounds[2][0].messages
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user", "assistant", "user"]
    # sessions: turn t of session s is in round t, same image, history grows by one exchange
    assert len(mt.sessions) == 2 and all(len(s) == 3 for s in mt.sessions)
    assert sorted(i for s in mt.sessions for i in s) == list(range(mt.num_requests))
    for s in mt.sessions:
        turns = [mt.prompts[i] for i in s]
        assert [i // 2 for i in s] == [0, 1, 2]
        assert len({tuple(p.images) for p in turns}) == 1
        for a, b in zip(turns, turns[1:], strict=False):
            assert b.messages[: len(a.messages)] == a.messages
    assert len({mt.prompts[s[0]].images[0] for s in mt.sessions}) == 2
    frames = workloads.pan_frames(6, repeat_every=3)
    assert frames[2] == frames[1] and frames[5] == frames[4]
    assert len(set(frames)) == 4


def test_closed_loop_matches_lock_step(loaded, model_dir: Path) -> None:
    mm = MMServeRunner(loaded, str(model_dir))
    wl = workloads.multi_turn(3, 3, 2)
    closed = mm.run(wl, "closed", radix_cache=True)
    lock = mm.run(wl, "lock", radix_cache=True, closed_loop=False)
    assert any("closed loop" in n for n in closed.notes)
    assert not any("closed loop" in n for n in lock.notes)
    for r in (closed, lock):
        assert r.all_finished and r.leak_free and len(r.outputs) == wl.num_requests
        assert len(r.ttfts_s) == wl.num_requests and min(r.ttfts_s) >= 0.0
    assert closed.outputs == lock.outputs  # same prompts, greedy: same tokens
    with pytest.raises(ValueError, match="no sessions"):
        mm.run(workloads.many_questions(1, 1, 2), "x", radix_cache=True, closed_loop=True)


def test_harness_end_to_end(tmp_path: Path, model_dir: Path) -> None:
    out = tmp_path / "results"
    assert main(["--scale", "ci", "--model", str(model_dir), "--out", str(out)]) == 0
    on_policies = [p for p in POLICIES if policy_supported(p) is None]
    assert MAIN_POLICY in on_policies
    for name in WORKLOADS:
        res = json.loads((out / f"{name}.json").read_text())
        systems = {s["system"]: s for s in res["systems"]}
        expected = {"transformers", "mmserve-off", *(f"mmserve-{p}" for p in on_policies)}
        assert expected <= set(systems), (name, set(systems))
        opt = res["prompts"]["optimal_hit_rate"]
        assert 0.0 <= opt < 1.0
        for s in systems.values():
            assert 0.0 <= s["cache_hit_rate"] <= 1.0, (name, s["system"])
            assert 0.0 <= s["tree_fraction"] <= 1.0
            assert s["requests_per_s"] > 0 and s["output_tokens"] > 0
            assert s["all_finished"], (name, s["system"])
            if s["kind"] == "mmserve":
                assert s["leak_free"], (name, s["system"], s["notes"])
                # cache-on may not beat the offline optimum (one token is always computed)
                assert s["cache_hit_rate"] <= opt + 1e-9
        assert systems["mmserve-off"]["cache_hit_rate"] == 0.0
        assert systems["transformers"]["cache_hit_rate"] == 0.0
        if name != "no_sharing":
            assert systems[f"mmserve-{MAIN_POLICY}"]["cache_hit_rate"] > 0.0
        for label, cmp in res["comparisons"].items():
            if label.startswith("mmserve"):
                assert cmp["mismatches_vs_off"] == 0, (name, label)
    mt = json.loads((out / "multi_turn.json").read_text())
    assert mt["arrival"] == "closed-loop"
    halves = {s["system"] for s in mt["systems"] if s["system"].endswith("-halfpool")}
    assert halves == {f"mmserve-{p}-halfpool" for p in on_policies}
    sweeps = json.loads((out / "pool_sweep.json").read_text())
    assert set(sweeps) == {"many_questions", "multi_turn"}
    for sweep in sweeps.values():
        pools = [p["pool_tokens"] for p in sweep["points"]]
        assert max(pools) == sweep["working_set_tokens"]
        assert min(pools) == sweep["one_request_tokens"]
        for p in sweep["points"]:
            assert p["all_finished"] and p["leak_free"] and p["output_mismatches"] == 0
            assert 0.0 <= p["cache_hit_rate"] <= sweep["optimal_hit_rate"] + 1e-9
    try:
        import matplotlib  # noqa: F401  (optional: the "bench" extra)
    except ImportError:
        pass
    else:
        assert (out / "pool_sweep.png").stat().st_size > 0
    summary = (out / "summary.md").read_text()
    assert "## Targets" in summary and "## many_questions" in summary
    targets = json.loads((out / "targets.json").read_text())["targets"]
    assert len(targets) >= 10
    assert all(t["met"] in (True, False) for t in targets)
