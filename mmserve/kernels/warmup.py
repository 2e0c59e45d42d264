"""Kernel warm-up: build or load every GPU kernel a model needs before it serves.

FlashInfer compiles its kernels on first use (JIT, into ``~/.cache/flashinfer``): on a
fresh host the first request would otherwise wait minutes with nothing in the log. The
server runs :func:`warm_up_kernels` at start-up, before ``/health`` says ok, with one log
line per module and its time; ``scripts/gpu_check.sh`` runs :func:`prebuild` (this
module's command line) as its first GPU phase, building the modules of several shapes
at once in separate processes so that their compiles share all cores.

Each step runs the real kernel once on tiny inputs through the same code the model runs
(the attention wrappers with the backend's plan arguments; ``mmserve.kernels.ops`` for
the fused norm, RoPE and SiLU-and-mul), so the module it builds is the one a request
would: FlashInfer keys a module by its dtypes, head dim and variant, not by sizes.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelStep:
    """One kernel module to build or load: ``run`` calls it once on tiny inputs."""

    name: str
    run: Callable[[], None]


@dataclass(frozen=True)
class KernelShape:
    """What selects a model's kernel modules.

    Attributes:
        num_qo_heads: query heads ``Hq``.
        num_kv_heads: K/V heads ``Hkv``.
        head_dim: dimension per head ``D``.
        dtype: activation dtype (fp16 or bf16 for FlashInfer).
        kv_dtype: KV pool dtype (``dtype`` or ``torch.float8_e4m3fn``).
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_dtype: torch.dtype

    def label(self) -> str:
        """``"14/2 heads d64 q bfloat16 kv float8_e4m3fn"``."""
        dt, kv = str(self.dtype).removeprefix("torch."), str(self.kv_dtype).removeprefix("torch.")
        return f"{self.num_qo_heads}/{self.num_kv_heads} heads d{self.head_dim} q {dt} kv {kv}"


def _attention_steps(shape: KernelShape, device: torch.device) -> list[Callable[[], None]]:
    """FlashInfer's paged prefill and decode for ``shape``, planned as
    :class:`~mmserve.kernels.flashinfer_backend.FlashInferAttentionBackend` plans them."""
    from mmserve.kernels.flashinfer_backend import (
        _TENSOR_CORE_DECODE_MIN_GROUP,
        import_flashinfer,
    )

    fi = import_flashinfer()
    hq, hkv, d = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim
    page = 4
    tensor_cores = hq // hkv >= _TENSOR_CORE_DECODE_MIN_GROUP

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    types = {
        "pos_encoding_mode": "NONE",
        "q_data_type": shape.dtype,
        "kv_data_type": shape.kv_dtype,
    }
    scales = {"k_scale": 1.0, "v_scale": 1.0} if shape.kv_dtype != shape.dtype else {}

    def pages() -> tuple[torch.Tensor, ...]:
        kv = torch.zeros(1, page, hkv, d, device=device).to(shape.kv_dtype)
        return (i32([0, 1]), i32([0]), i32([2]), kv)

    def prefill() -> None:
        ws = torch.zeros(16 * 1024 * 1024, dtype=torch.uint8, device=device)
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="NHD")
        indptr, indices, last, kv = pages()
        qo = i32([0, 2])
        w.plan(qo, indptr, indices, last, hq, hkv, d, page, causal=True, **types)
        w.run(torch.zeros(2, hq, d, dtype=shape.dtype, device=device), (kv, kv), **scales)

    def decode() -> None:
        ws = torch.zeros(16 * 1024 * 1024, dtype=torch.uint8, device=device)
        w = fi.BatchDecodeWithPagedKVCacheWrapper(
            ws, kv_layout="NHD", use_tensor_cores=tensor_cores
        )
        indptr, indices, last, kv = pages()
        w.plan(indptr, indices, last, hq, hkv, d, page, **types)
        w.run(torch.zeros(1, hq, d, dtype=shape.dtype, device=device), (kv, kv), **scales)

    return [prefill, decode]


def _fused_op_steps(
    shape: KernelShape, device: torch.device, flashinfer: bool
) -> list[Callable[[], None]]:
    """The fused norm, RoPE and SiLU-and-mul through ``mmserve.kernels.ops``, inside
    ``ops.fused_ops(flashinfer)`` as the decoder's forward runs them (whatever those pick
    on this device and dtype is what is built)."""
    from mmserve.kernels import ops

    def within(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with ops.fused_ops(flashinfer):
                fn()

        return run

    dt, d = shape.dtype, shape.head_dim
    hidden = 64  # norm/activation modules do not depend on the width

    def norm() -> None:
        x = torch.ones(2, hidden, dtype=dt, device=device)
        w = torch.ones(hidden, dtype=dt, device=device)
        ops.rms_norm(x, w, 1e-6)
        ops.fused_add_rms_norm(x, torch.ones_like(x), w, 1e-6)

    def rope() -> None:
        cache = ops.cos_sin_cache(ops.rope_inv_freq(d, 10000.0).to(device), 8)
        q = torch.ones(2, shape.num_qo_heads * d, dtype=dt, device=device)
        k = torch.ones(2, shape.num_kv_heads * d, dtype=dt, device=device)
        ops.apply_rope(torch.arange(2, device=device), q, k, d, cache)

    def act() -> None:
        ops.silu_and_mul(torch.ones(2, 2 * hidden, dtype=dt, device=device))

    return [within(norm), within(rope), within(act)]


def kernel_steps(
    shape: KernelShape, device: torch.device | str, attention_backend: str
) -> list[KernelStep]:
    """The kernel modules a model of ``shape`` runs on ``device``: with
    ``attention_backend`` ``"flashinfer"`` (the resolved name, not ``"auto"``) its prefill
    and decode and the fused ops; with ``"torch"`` only the fused ops' torch versions,
    which build nothing (the server warms up only FlashInfer on CUDA; tests use them to
    check the machinery on CPU)."""
    device = torch.device(device)
    runs = _fused_op_steps(shape, device, attention_backend == "flashinfer")
    if attention_backend == "flashinfer":
        runs = _attention_steps(shape, device) + runs
    return [
        KernelStep(n, r) for n, r in zip(_step_names(shape, attention_backend), runs, strict=True)
    ]


def warm_up_kernels(
    steps: Sequence[KernelStep], log: logging.Logger | None = None
) -> list[tuple[str, float]]:
    """Run each step once, in order, logging ``kernel warm-up: NAME ready in S s``
    (building on a fresh host, loading from the JIT cache after).

    Returns:
        ``[(name, seconds)]`` in run order.

    Raises:
        RuntimeError: naming the module whose build or first run failed (the cause
            chained), so that a server never says it is healthy with a kernel it
            cannot run.
    """
    log = log or logger
    if not steps:
        return []
    log.info("kernel warm-up: %d modules to build or load", len(steps))
    done, start = [], time.perf_counter()
    for step in steps:
        t0 = time.perf_counter()
        try:
            step.run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        except Exception as e:
            raise RuntimeError(f"kernel warm-up: {step.name} failed: {e}") from e
        took = time.perf_counter() - t0
        done.append((step.name, took))
        log.info("kernel warm-up: %s ready in %.1f s", step.name, took)
    log.info("kernel warm-up: done, %d modules in %.1f s", len(done), time.perf_counter() - start)
    return done


# --- prebuild: several shapes at once ------------------------------------------------


def parse_shape(text: str) -> tuple[KernelShape, str]:
    """``"HQ/HKV/D/DTYPE[/KV_DTYPE[/BACKEND]]"`` -> shape and backend, e.g.
    ``"14/2/64/bfloat16/float8_e4m3fn"``; backend ``flashinfer`` unless given.

    Raises:
        ValueError: for a malformed spec or an unknown dtype.
    """
    parts = text.split("/")
    if not 4 <= len(parts) <= 6:
        raise ValueError(f"shape {text!r}: want HQ/HKV/D/DTYPE[/KV_DTYPE[/BACKEND]]")
    dtypes = []
    for name in parts[3:5]:
        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"shape {text!r}: unknown dtype {name!r}")
        dtypes.append(dt)
    kv = dtypes[1] if len(dtypes) > 1 else dtypes[0]
    backend = parts[5] if len(parts) == 6 else "flashinfer"
    shape = KernelShape(int(parts[0]), int(parts[1]), int(parts[2]), dtypes[0], kv)
    return shape, backend


def _run_one(spec: str, index: int, device: str) -> tuple[str, float]:
    """In a worker process: step ``index`` of ``spec``'s steps."""
    shape, backend = parse_shape(spec)
    step = kernel_steps(shape, device, backend)[index]
    return warm_up_kernels([step])[0]


def prebuild(
    specs: Sequence[str], jobs: int | None = None, device: str = "cuda"
) -> list[tuple[str, float]]:
    """Build the modules of every shape in ``specs`` (see :func:`parse_shape`), each
    distinct module in its own process, up to ``jobs`` at once (default: the CPU
    count), so that independent compiles overlap; ninja inside each uses all cores.

    Returns:
        ``[(name, seconds)]`` in completion order.

    Raises:
        RuntimeError: if any module failed (all are tried first).
    """
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    work: dict[str, tuple[str, int]] = {}
    for spec in specs:
        shape, backend = parse_shape(spec)
        # names only (no CUDA work in this process): meta device stands in for cuda
        for i, name in enumerate(_step_names(shape, backend)):
            work.setdefault(name, (spec, i))
    jobs = max(1, min(len(work), jobs or os.cpu_count() or 1))
    print(f"prebuild: {len(work)} modules, {jobs} processes", flush=True)
    done, failed = [], []
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = {pool.submit(_run_one, spec, i, device): name for name, (spec, i) in work.items()}
        for fut in as_completed(futures):
            try:
                name, took = fut.result()
            except Exception as e:  # noqa: BLE001 - every module is tried, all failures listed
                failed.append(f"{futures[fut]}: {e}")
                print(f"prebuild: FAILED {futures[fut]}: {e}", flush=True)
                continue
            done.append((name, took))
            print(f"prebuild: {name} ready in {took:.1f} s", flush=True)
    if failed:
        raise RuntimeError("prebuild failed: " + "; ".join(failed))
    return done


def _step_names(shape: KernelShape, backend: str) -> list[str]:
    """:func:`kernel_steps`' names for a CUDA device, without touching CUDA."""
    label, dtn = shape.label(), str(shape.dtype).removeprefix("torch.")
    names = []
    if backend == "flashinfer":
        from mmserve.kernels.flashinfer_backend import _TENSOR_CORE_DECODE_MIN_GROUP

        tc = shape.num_qo_heads // shape.num_kv_heads >= _TENSOR_CORE_DECODE_MIN_GROUP
        names += [
            f"attention prefill ({label})",
            f"attention {'tensor-core ' if tc else ''}decode ({label})",
        ]
    names += [
        f"rmsnorm + fused add-rmsnorm ({dtn})",
        f"rope cos/sin cache ({dtn}, d{shape.head_dim})",
        f"silu_and_mul ({dtn})",
    ]
    return names


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mmserve.kernels.warmup SHAPE...``: :func:`prebuild` (exit 1 if a
    module failed)."""
    p = argparse.ArgumentParser(prog="python -m mmserve.kernels.warmup", description=__doc__)
    p.add_argument("shapes", nargs="+", help="HQ/HKV/D/DTYPE[/KV_DTYPE[/BACKEND]]")
    p.add_argument("--jobs", type=int, default=None, help="processes at once (CPU count)")
    p.add_argument("--device", default="cuda", help="cuda (cpu: only the process machinery)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    try:
        done = prebuild(args.shapes, args.jobs, args.device)
    except RuntimeError as e:
        print(e, flush=True)
        return 1
    print(f"prebuild: {len(done)} modules in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
