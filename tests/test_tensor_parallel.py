"""Tensor parallelism (``EngineConfig.tp`` / ``--tp``): two ranks on CPU with gloo.

Oracle: the same checkpoint on one rank. Greedy tokens must be identical (the tiny
checkpoints' top-2 logit margins are far wider than the all-reduce's rounding) and
logits agree within ``TP_LOGIT_RTOL`` of the largest |logit| (measured: ~1e-6).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from api.cli import main
from mmserve.config import EngineConfig
from mmserve.distributed.layout import TPLayout, check_tp
from mmserve.frontend.frontend import Engine
from mmserve.model.llama import LlamaShape
from mmserve.structured.spec import GuidedSpec
from mmserve.types import SamplingParams
from tests.helpers import ANY_PORT, TINY_FAMILIES, greedy, tp_engine, user, workload
from tests.live_server import (
    child_pids,
    cmdline,
    live_server_process,
    parent_pid,
    pid_alive,
    wait_gone,
)

TP_LOGIT_RTOL = 1e-4
CHOICES = ["a red bicycle", "a green tram", "two blue boats"]


def _shape(h: int = 8, hkv: int = 2, inter: int = 64, vocab: int = 101) -> LlamaShape:
    return LlamaShape(vocab, 32, inter, 2, h, hkv, 4, 1e-6, 1e4, 128)


def _assert_equal_runs(ours, ref, what: str, same_cache: bool = True) -> None:
    for k, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a.output_ids == b.output_ids, f"{what} #{k}: {a.output_ids} != {b.output_ids}"
        assert a.finish_reason == b.finish_reason
        assert a.cached_tokens == b.cached_tokens or not same_cache
        for step, (la, lb) in enumerate(zip(a.logits, b.logits, strict=True)):
            finite = torch.isfinite(lb)
            assert torch.equal(finite, torch.isfinite(la)), f"{what} #{k} step {step}"
            diff = (la[finite] - lb[finite]).abs().max().item()
            tol = TP_LOGIT_RTOL * max(1.0, lb[finite].abs().max().item())
            assert diff <= tol, f"{what} #{k} step {step}: logits differ by {diff} > {tol}"


def _requests(eng, imgs, guided: bool = True) -> list:
    """Images shared across requests (cache hits), history, text only, sampled
    requests with seeds (as ``n`` > 1 makes them) and one structured-output request."""
    reqs = [
        eng.processor.make_request(messages=m, images=i, params=greedy(6))
        for m, i in workload(imgs)
    ]
    for seed in range(3):
        params = SamplingParams(max_tokens=6, temperature=0.9, seed=seed, return_logits=True)
        reqs.append(
            eng.processor.make_request(messages=user(None, "Hi"), images=imgs[:1], params=params)
        )
    if guided:
        params = greedy(24, guided=GuidedSpec.choice(CHOICES))
        reqs.append(
            eng.processor.make_request(messages=user(None, "JSON"), images=imgs[:1], params=params)
        )
    return reqs


def _layer_bytes(decoder) -> int:
    return sum(p.numel() * p.element_size() for p in decoder.layers.parameters())


# ---- start-up refusals ------------------------------------------------------------


def test_check_tp_refuses_what_cannot_be_split(monkeypatch) -> None:
    check_tp(_shape(), 8)  # 8 query heads, K/V heads 2 replicated 4 times
    check_tp(_shape(), 2)
    with pytest.raises(ValueError, match="does not divide the model's 8 query heads"):
        check_tp(_shape(), 3)
    with pytest.raises(ValueError, match="K/V heads divide neither way"):
        check_tp(_shape(h=12, hkv=4), 6)
    with pytest.raises(ValueError, match="MLP width 66"):
        check_tp(_shape(inter=66), 4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 CUDA devices, but 1 are visible"):
        check_tp(_shape(), 2, "cuda")
    with pytest.raises(ValueError, match="tp must be >= 1"):
        EngineConfig(tp=0).validate()


def test_serve_refuses_a_tp_that_does_not_divide_the_heads(model_dir, capsys) -> None:
    before = set(child_pids(os.getpid()))
    assert main(["serve", *ANY_PORT, "--model", str(model_dir), "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "--tp 3 does not divide the model's 2 query heads; choose one of 1, 2" in err
    assert set(child_pids(os.getpid())) <= before  # refused before any rank started


@pytest.mark.parametrize("world", [2, 4, 8])
def test_layout_slices_tile_every_weight(world: int) -> None:
    full = _shape(h=8, hkv=2 if world > 2 else 4)
    layouts = [TPLayout(r, world, full) for r in range(world)]
    d = full.head_dim
    assert [lay.q_rows() for lay in layouts] == [
        (r * 8 // world * d, (r + 1) * 8 // world * d) for r in range(world)
    ]
    for lay in layouts:  # each rank's query heads use exactly its K/V heads
        group = full.num_heads // full.num_kv_heads
        q_heads = range(lay.q_rows()[0] // d, lay.q_rows()[1] // d)
        kv = {h // group for h in q_heads}
        assert kv == set(range(lay.kv_rows()[0] // d, lay.kv_rows()[1] // d))
    vocab = [lay.vocab_rows() for lay in layouts]
    assert vocab[0][0] == 0 and vocab[-1][1] == full.vocab_size
    assert all(a[1] == b[0] for a, b in zip(vocab, vocab[1:], strict=False))
    mlp = [lay.mlp_rows() for lay in layouts]
    assert mlp[0][0] == 0 and mlp[-1][1] == full.intermediate_size


# ---- equal outputs ------------------------------------------------------------------


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tp2_equals_tp1_per_family(family: str, families, photos) -> None:
    model_dir = families[family].model_dir
    one = families[family].make_engine()
    imgs = [one.processor.prepare_image(b) for b in list(photos.values())[:3]]
    ref = one.generate(_requests(one, imgs))
    with tp_engine(model_dir) as two:
        dec = two.model.decoder
        res = two.generate(_requests(two, imgs))
        two.check_accounting()
        pids = dec.group.pids
        assert all(pid_alive(p) for p in pids) and two.fatal_error() is None
        # the pool holds this rank's K/V heads; weights are sharded, not copied
        assert two.pool.k_buffers[0].shape[2] == dec.layout.kv_heads
        full = one.model.decoder
        assert _layer_bytes(dec) <= 0.6 * _layer_bytes(full)
        full_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
        assert 0 < dec.group.worker_bytes[0] <= 0.6 * full_bytes
    assert sum(r.cached_tokens for r in res) > 0  # the radix cache was hit under tp 2
    _assert_equal_runs(res, ref, f"{family} tp2 vs tp1")
    assert res[-1].text in CHOICES
    assert wait_gone(pids, 10) == []


def test_tp2_splits_kv_heads_of_the_small_checkpoint(small_model_dir: Path) -> None:
    # the tiny checkpoints have one K/V head (replicated); the small one has two (split)
    prompts = ["Once upon a time", "The capital of France is", "List three colours:"]

    def run(eng):
        mk = eng.processor.make_request
        return eng.generate([mk(prompt=p, params=greedy(8)) for p in prompts])

    ref = run(Engine(EngineConfig(model_path=str(small_model_dir), dtype="float32")))
    with tp_engine(small_model_dir) as eng:
        assert eng.model.decoder.layout.kv_heads == 1 and eng.pool.k_buffers[0].shape[2] == 1
        assert eng.model.decoder.layout.kv_head_start == 0
        res = run(eng)
    _assert_equal_runs(res, ref, "small tp2 vs tp1")


def test_tp2_cache_on_equals_cache_off(model_dir, make_engine, photos) -> None:
    imgs = [make_engine().processor.prepare_image(b) for b in list(photos.values())[:3]]
    runs = []
    for cfg in ({"page_size": 1}, {"disable_radix_cache": True, "page_size": 16}):
        with tp_engine(model_dir, **cfg) as eng:
            runs.append(eng.generate(_requests(eng, imgs, guided=False)))
            eng.check_accounting()
    assert sum(r.cached_tokens for r in runs[0]) > 0
    assert all(r.cached_tokens == 0 for r in runs[1])
    _assert_equal_runs(runs[1], runs[0], "tp2 cache off vs on", same_cache=False)


# ---- faults -------------------------------------------------------------------------


def test_worker_killed_mid_request_fails_it_and_leaves_no_process(model_dir) -> None:
    with tp_engine(model_dir, tp_timeout_seconds=30) as eng:
        pids = eng.model.decoder.group.pids
        cols = [
            eng.track(eng.processor.make_request(prompt=f"Count {k}", params=greedy(200)))
            for k in range(2)
        ]
        for _ in range(3):
            eng.step()
        assert not any(c.finished for c in cols)
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.time() + 60
        while not all(c.finished for c in cols):
            assert time.time() < deadline, "requests did not end after a rank died"
            eng.step()
        for c in cols:
            assert c.result.finish_reason == "error"
            assert 0 < len(c.result.output_ids) < 200
        assert "tensor-parallel group down" in eng.fatal_error()
        # later requests fail at once instead of waiting on a dead group
        late = eng.generate([eng.processor.make_request(prompt="again", params=greedy(4))])[0]
        assert late.finish_reason == "error" and late.output_ids == []
        eng.check_accounting()
    assert wait_gone(pids, 10) == []


def _open_stream_until_text(url: str, body: dict):
    """POST a streaming chat completion; return the response once a chunk with text
    arrived (the request is generating)."""
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    resp = urllib.request.urlopen(req, timeout=60)
    while True:
        line = resp.readline()
        assert line, "stream ended before any text"
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            if any(c["delta"].get("content") for c in event.get("choices", [])):
                return resp


def test_server_tp2_answers_then_a_dead_rank_ends_it_cleanly(model_dir: Path) -> None:
    with live_server_process(
        model_dir, "--tp", "2", "--fatal-exit-seconds", "8", "--tp-timeout-seconds", "30"
    ) as (url, proc):
        # the server's child is the engine process; rank 1 is the engine's child
        workers = [
            p
            for p in child_pids(proc.pid)
            if "spawn_main" in cmdline(p)
            and "resource_tracker" not in cmdline(p)
            and parent_pid(p) != proc.pid
        ]
        assert len(workers) == 1, [cmdline(p) for p in child_pids(proc.pid)]
        everyone = child_pids(proc.pid)
        body = {
            "model": model_dir.name,
            "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 5,
            "temperature": 0,
            "n": 2,
        }
        req = urllib.request.Request(
            f"{url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            choices = json.loads(r.read())["choices"]
        assert [c["finish_reason"] for c in choices] == ["length", "length"]
        resp = _open_stream_until_text(
            url, {**body, "max_tokens": 4000, "ignore_eos": True, "stream": True}
        )
        os.kill(workers[0], signal.SIGKILL)
        events = [
            json.loads(line[6:]) for line in resp.read().splitlines() if line.startswith(b"data: {")
        ]
        assert events and events[-1]["error"]["type"] == "server_error", events[-3:]
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"{url}/health", timeout=10)
        assert info.value.code == 503
        err = json.loads(info.value.read())["error"]
        assert err["code"] == "engine_unhealthy" and "tensor-parallel" in err["message"]
        assert proc.wait(timeout=60) == 1  # shut itself down after --fatal-exit-seconds
    assert wait_gone(everyone, 10) == []


def test_a_hung_worker_times_out_and_is_killed(model_dir) -> None:
    with tp_engine(model_dir, tp_timeout_seconds=3) as eng:
        pid = eng.model.decoder.group.pids[0]
        os.kill(pid, signal.SIGSTOP)  # alive but never answers
        res = eng.generate([eng.processor.make_request(prompt="hi", params=greedy(4))])[0]
        assert res.finish_reason == "error" and "TPGroupError" in res.error
        assert "Timed out" in eng.fatal_error()
        assert wait_gone([pid], 10) == []


def test_workers_exit_when_rank_0_is_killed(model_dir: Path) -> None:
    with live_server_process(model_dir, "--tp", "2") as (_, proc):
        everyone = child_pids(proc.pid)
        assert everyone
        proc.kill()  # no clean-up code runs in rank 0
        proc.wait(timeout=10)
        assert wait_gone(everyone, 15) == []


def test_a_replica_reserves_every_rank_on_one_actor() -> None:
    from mmserve.fleet.settings import ReplicaSettings

    rs = ReplicaSettings(replicas=2, cpus_per_replica=2.0)
    assert rs.actor_options("cuda", 4) == {"num_cpus": 8.0, "num_gpus": 4.0}
    assert rs.actor_options("cpu", 2) == {"num_cpus": 4.0, "num_gpus": 0.0}
    assert rs.actor_options("cuda") == {"num_cpus": 2.0, "num_gpus": 1.0}
