"""The start-up kernel warm-up (issue 48): every GPU kernel module the model runs is
built or loaded before ``/health`` says ok, with one log line per module and its time.

The build itself needs CUDA; here the steps are fakes, which is enough to check the
order (warm-up, then the engine thread, then a healthy ``/health``), the log lines,
a failing module, and that the engine asks for the modules of its own model's shape."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading

import httpx
import pytest
import torch

import mmserve.engine.engine as engine_mod
from api.app import ServerSettings, create_app
from mmserve.kernels.warmup import (
    KernelShape,
    KernelStep,
    _step_names,
    kernel_steps,
    parse_shape,
    warm_up_kernels,
)


def test_warm_up_logs_one_line_per_module_in_order(caplog: pytest.LogCaptureFixture) -> None:
    ran: list[str] = []
    steps = [KernelStep(n, lambda n=n: ran.append(n)) for n in ("prefill", "decode", "norm")]
    with caplog.at_level(logging.INFO, logger="mmserve.kernels.warmup"):
        done = warm_up_kernels(steps)
    assert ran == ["prefill", "decode", "norm"]
    assert [name for name, _ in done] == ran
    assert all(s >= 0 for _, s in done)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "kernel warm-up: 3 modules to build or load"
    for line, name in zip(lines[1:4], ran, strict=True):
        assert line.startswith(f"kernel warm-up: {name} ready in ") and line.endswith(" s")
    assert lines[4].startswith("kernel warm-up: done, 3 modules in ")


def test_warm_up_names_the_module_that_failed() -> None:
    def broken() -> None:
        raise OSError("nvcc: not found")

    with pytest.raises(RuntimeError, match=r"kernel warm-up: decode \(x\) failed: nvcc"):
        warm_up_kernels([KernelStep("norm", lambda: None), KernelStep("decode (x)", broken)])


def test_no_kernels_to_warm_off_cuda(make_engine) -> None:
    assert make_engine().warm_up_kernels() == []


def test_kernel_steps_run_the_fused_ops_in_order() -> None:
    shape, _ = parse_shape("4/2/16/float32")
    steps = kernel_steps(shape, "cpu", "torch")
    assert [s.name for s in steps] == _step_names(shape, "torch")
    for s in steps:
        s.run()  # the torch versions on CPU: runs, builds nothing


def test_prebuild_runs_each_distinct_module_once_in_worker_processes() -> None:
    """The command line gpu_check.sh runs, on CPU (the torch ops: only the process
    machinery is checked): modules shared by two shapes run once, one line each; a
    module that fails is named and the exit status is 1."""
    cmd = [sys.executable, "-m", "mmserve.kernels.warmup", "--device", "cpu", "--jobs", "2"]
    ok = subprocess.run(
        [*cmd, "8/2/64/float32/float32/torch", "14/2/64/float32/float32/torch"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert lines[0] == "prebuild: 3 modules, 2 processes"  # heads do not matter to these
    ready = sorted(line.split(" ready in ")[0] for line in lines[1:-1])
    assert ready == sorted(
        f"prebuild: {n}"
        for n in {
            *_step_names(parse_shape("8/2/64/float32/float32/torch")[0], "torch"),
            *_step_names(parse_shape("14/2/64/float32/float32/torch")[0], "torch"),
        }
    )
    assert lines[-1].startswith("prebuild: 3 modules in ")
    # FlashInfer's attention on a CPU device: fails whether or not flashinfer imports
    bad = subprocess.run([*cmd, "8/2/64/bfloat16"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert "prebuild: FAILED attention prefill (8/2 heads d64 q bfloat16 kv bfloat16)" in bad.stdout
    assert "prebuild failed: " in bad.stdout


def test_module_names_of_onevision_shapes() -> None:
    """OneVision-0.5B's 14/2 heads (group 7) use the tensor-core decode module; fp8 KV
    gets its own attention modules, the fused ops do not depend on the KV dtype."""
    shape, backend = parse_shape("14/2/64/bfloat16/float8_e4m3fn")
    assert shape == KernelShape(14, 2, 64, torch.bfloat16, torch.float8_e4m3fn)
    assert _step_names(shape, backend) == [
        "attention prefill (14/2 heads d64 q bfloat16 kv float8_e4m3fn)",
        "attention tensor-core decode (14/2 heads d64 q bfloat16 kv float8_e4m3fn)",
        "rmsnorm + fused add-rmsnorm (bfloat16)",
        "rope cos/sin cache (bfloat16, d64)",
        "silu_and_mul (bfloat16)",
    ]
    small, _ = parse_shape("4/2/16/float16/float16/torch")
    assert _step_names(small, "torch") == [
        "rmsnorm + fused add-rmsnorm (float16)",
        "rope cos/sin cache (float16, d16)",
        "silu_and_mul (float16)",
    ]
    with pytest.raises(ValueError, match="unknown dtype 'bf16'"):
        parse_shape("14/2/64/bf16")


def test_engine_asks_for_its_model_shape(make_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = []

    def fake_steps(shape, device, backend):
        asked.append((shape, torch.device(device), backend))
        return [KernelStep("fake", lambda: None)]

    monkeypatch.setattr(engine_mod, "kernel_steps", fake_steps)
    eng = make_engine()
    monkeypatch.setattr(eng.runner, "device", torch.device("cuda"))  # as if on a GPU
    # --attention-backend torch runs the torch fused ops too: nothing to build
    assert eng.warm_up_kernels() == [] and asked == []
    monkeypatch.setattr(eng.runner.backend, "name", "flashinfer")
    assert [n for n, _ in eng.warm_up_kernels()] == ["fake"]
    s = eng.model.decoder.shape
    want = KernelShape(s.num_heads, s.num_kv_heads, s.head_dim, eng.runner.dtype, eng.pool.dtype)
    assert asked == [(want, torch.device("cuda"), "flashinfer")]


def test_health_is_not_ok_until_the_warm_up_is_done(make_engine) -> None:
    """The lifespan runs the warm-up before the engine thread starts; ``/health`` answers
    503 ``warming_up`` until it has finished, then 200."""
    eng = make_engine()
    app = create_app(eng, ServerSettings(served_model_name="m"))
    entered, release = threading.Event(), threading.Event()
    order: list[str] = []
    aengine = app.state.mm.aengine

    def slow_warm_up() -> list[tuple[str, float]]:
        order.append(f"warm-up (engine thread alive: {aengine._thread.is_alive()})")
        entered.set()
        assert release.wait(10)
        order.append("warm-up done")
        return []

    eng.warm_up_kernels = slow_warm_up  # type: ignore[method-assign]

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)  # no lifespan: this test drives it
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            ctx = app.router.lifespan_context(app)
            startup = asyncio.ensure_future(ctx.__aenter__())
            assert await asyncio.to_thread(entered.wait, 10)
            r = await client.get("/health")
            order.append(f"health {r.status_code} {r.json()['error']['code']}")
            release.set()
            await asyncio.wait_for(startup, 10)
            r = await client.get("/health")
            order.append(f"health {r.status_code} {r.json()}")
            order.append(f"engine thread alive: {aengine._thread.is_alive()}")
            await ctx.__aexit__(None, None, None)

    asyncio.run(scenario())
    assert order == [
        "warm-up (engine thread alive: False)",
        "health 503 warming_up",
        "warm-up done",
        "health 200 {'status': 'ok'}",
        "engine thread alive: True",
    ]
