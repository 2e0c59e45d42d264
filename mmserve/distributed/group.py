"""Tensor parallelism: rank 0 runs the engine, ranks 1..N-1 run decoder shards.

Rank 0 is the ordinary :class:`~mmserve.frontend.frontend.Engine` process (scheduler,
radix tree, vision tower, embedding cache, sampling, front end). It starts the other
ranks with ``torch.multiprocessing`` (spawn) on this machine and joins them in a
``torch.distributed`` group over a ``TCPStore`` on 127.0.0.1 (gloo on CPU, NCCL on
CUDA). Every step, :class:`TPDecoder` (rank 0's decoder) sends each worker a small
header over its pipe, then broadcasts the step's embeddings ``[T, hidden]`` (text
embeddings with image features already in) and one int64 tensor with the attention
metadata; every rank runs :meth:`ShardedDecoder.forward` on its heads, and
rank 0 gathers the vocabulary slices of the logits.

Faults: every collective has the group's timeout (``EngineConfig.tp_timeout_seconds``).
A worker that exits, or a step that raises or times out after the header went out,
leaves the group unusable: :attr:`TPGroup.failure` says why, the remaining workers are
killed, the failing step's requests end with finish reason "error" and every later
step fails at once. A worker exits when rank 0's end of its pipe closes (rank 0
exited) or when it is re-parented (checked every second), so none outlives rank 0.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing.connection
import os
import socket
import threading
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmserve.cache.kv_pool import KVPool
from mmserve.config import EngineConfig, pool_tokens
from mmserve.distributed.layout import TPLayout, check_tp
from mmserve.distributed.shard import ShardedDecoder
from mmserve.distributed.worker import (
    StepHeader,
    WorkerSpec,
    gather_logits,
    init_group,
    rank_device,
    step_tensors,
    worker_main,
)
from mmserve.kernels.backend import AttentionBackend
from mmserve.kernels.metadata import AttentionMetadata
from mmserve.model.llama import LlamaShape
from mmserve.model.loader import (
    LoadedModel,
    assemble,
    load_vision,
    quantization_source,
    read_front_end,
    text_shape,
)
from mmserve.model.quant import check_quantization, checkpoint_method, resolve_method

log = logging.getLogger(__name__)

#: Longest wait for every worker to load its shard and join the group (seconds).
START_TIMEOUT_S = 1800.0
#: How long a closing worker may take to exit before it is killed (seconds).
EXIT_GRACE_S = 5.0


def _loopback_ifname() -> str | None:
    """Name of the loopback interface ("lo" on Linux), for gloo's sockets."""
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n.startswith("lo")), None)


class TPGroupError(RuntimeError):
    """The tensor-parallel group failed (a rank died, hung or raised); it cannot run again."""


class TPGroup:
    """Rank 0's handle on the worker processes and the process group.

    Args:
        config: engine settings (``tp``, ``device``, ``tp_timeout_seconds``, pool size).
        model_dir: the checkpoint every rank reads its slices from.
        dtype: model dtype.

    Attributes:
        failure: why the group is down, or None while it works.
        worker_bytes: decoder weight bytes of each worker rank (1..N-1).
    """

    def __init__(
        self, config: EngineConfig, model_dir: Path, shape: LlamaShape, dtype: torch.dtype
    ) -> None:
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed group already exists in this process")
        self.world = config.tp
        self.failure: str | None = None
        self.worker_bytes: list[int] = []
        self._closing = False
        self._lock = threading.Lock()
        if not os.environ.get("GLOO_SOCKET_IFNAME") and (lo := _loopback_ifname()):
            os.environ["GLOO_SOCKET_IFNAME"] = lo  # loopback only; workers inherit it
        timeout = datetime.timedelta(seconds=config.tp_timeout_seconds)
        self._store: dist.TCPStore | None = dist.TCPStore(
            "127.0.0.1", 0, self.world, is_master=True, timeout=timeout, wait_for_workers=False
        )
        self._spec = WorkerSpec(
            rank=0,
            world=self.world,
            port=self._store.port,
            model_dir=str(model_dir),
            shape=shape,
            device=config.device,
            dtype=dtype,
            attention_backend=config.attention_backend,
            quantization=config.quantization,
            num_pages=pool_tokens(config) // config.page_size,
            page_size=config.page_size,
            timeout_s=config.tp_timeout_seconds,
            threads=torch.get_num_threads(),
            deterministic=config.deterministic,
            disable_int8_onednn=config.disable_int8_onednn,
        )
        ctx = mp.get_context("spawn")
        self._procs: list[BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        for rank in range(1, self.world):
            ours, theirs = ctx.Pipe()
            spec = WorkerSpec(**{**self._spec.__dict__, "rank": rank})
            p = ctx.Process(
                target=worker_main,
                args=(spec, theirs, os.getpid()),
                name=f"mmserve-tp{rank}",
                daemon=True,
            )
            p.start()
            theirs.close()  # only the worker holds its end: EOF there when we exit
            self._procs.append(p)
            self._conns.append(ours)
        self._wake_r, self._wake_w = ctx.Pipe(duplex=False)
        self._watcher: threading.Thread | None = None

    @property
    def pids(self) -> list[int]:
        """Process ids of the worker ranks 1..N-1."""
        return [p.pid for p in self._procs if p.pid is not None]  # all started: all have one

    def join(self) -> None:
        """Wait for every worker to load its shard, then form the process group.

        Raises:
            TPGroupError: when a worker fails to load (its traceback in the message),
                exits, or does not report within :data:`START_TIMEOUT_S`.
        """
        pending = dict(enumerate(self._conns, start=1))
        deadline = time.monotonic() + START_TIMEOUT_S
        self.worker_bytes = [0] * (self.world - 1)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TPGroupError(f"tensor-parallel ranks {sorted(pending)} did not load in time")
            sentinels = {self._procs[r - 1].sentinel: r for r in pending}
            ready = multiprocessing.connection.wait([*pending.values(), *sentinels], left)
            for obj in ready:
                if isinstance(obj, int) and obj in sentinels:  # a worker's process ended
                    rank = sentinels[obj]
                else:
                    rank = next(r for r, c in pending.items() if c is obj)
                conn = pending[rank]
                msg = conn.recv() if conn.poll() else None
                if msg is None or msg[0] != "loaded":
                    why = msg[1] if msg else f"exit code {self._procs[rank - 1].exitcode}"
                    raise TPGroupError(f"tensor-parallel rank {rank} failed to start: {why}")
                self.worker_bytes[rank - 1] = msg[1]
                del pending[rank]
        assert self._store is not None, "join() after close()"
        init_group(self._spec, self._store)
        self._watcher = threading.Thread(target=self._watch, name="mmserve-tp-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        """Turn a worker's exit into :attr:`failure` (and kill the rest) right away."""
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs, start=1)}
        ready = multiprocessing.connection.wait([*sentinels, self._wake_r])
        if self._closing:
            return
        for obj in ready:
            if obj in sentinels:
                rank = sentinels[obj]
                self.fail(f"rank {rank} exited (code {self._procs[rank - 1].exitcode})")
                return

    def _worker_errors(self) -> str:
        out = []
        for rank, conn in enumerate(self._conns, start=1):
            try:
                while conn.poll():
                    msg = conn.recv()
                    if isinstance(msg, tuple) and msg[0] == "error":
                        out.append(f"rank {rank}: {msg[1].strip().splitlines()[-1]}")
            except (EOFError, OSError):
                continue
        return "; ".join(out)

    def fail(self, why: str) -> None:
        """Mark the group down (first reason wins) and kill every worker."""
        with self._lock:
            if self.failure is None:
                extra = self._worker_errors()
                self.failure = f"tensor-parallel group down: {why}" + (
                    f" ({extra})" if extra else ""
                )
                log.error("%s", self.failure)
        for p in self._procs:
            if p.is_alive():
                p.kill()

    def send_step(self, head: StepHeader) -> None:
        """Send every worker this step's header.

        Raises:
            TPGroupError: when the group is down already.
        """
        if self.failure is not None:
            raise TPGroupError(self.failure)
        for conn in self._conns:
            conn.send(head)

    def close(self) -> None:
        """Stop the workers (asked, then killed after :data:`EXIT_GRACE_S`) and leave the group."""
        if self._closing:
            return
        self._closing = True
        self._wake_w.send(None)
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + EXIT_GRACE_S
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(EXIT_GRACE_S)
        for conn in self._conns:
            conn.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # leaving anyway
                log.warning("destroy_process_group failed", exc_info=True)
        self._store = None


class PlanCapture:
    """Wraps rank 0's attention backend to keep the metadata of the planned batch,
    which :class:`TPDecoder` sends to the other ranks."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.deterministic = inner.deterministic
        self.meta: AttentionMetadata | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        """Plan ``inner`` and remember ``meta``."""
        self.meta = meta
        self.inner.plan(meta)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, pool: KVPool
    ) -> torch.Tensor:
        """``inner.forward``: see :class:`~mmserve.kernels.backend.AttentionBackend`."""
        return self.inner.forward(q, k, v, layer_id, pool)


class TPDecoder(ShardedDecoder):
    """Rank 0's decoder: the whole embedding, its own shard, and the group.

    Called by :class:`~mmserve.engine.model_runner.ModelRunner` exactly like
    :class:`~mmserve.model.llama.LlamaDecoder`; :meth:`bind` must wrap the runner's
    backend first so the batch's metadata can be broadcast.
    """

    def __init__(self, layout: TPLayout, group: TPGroup) -> None:
        super().__init__(layout, with_embedding=True)
        self.group = group

    def bind(self, runner: Any) -> None:
        """Wrap ``runner.backend`` in a :class:`PlanCapture` (``runner``: the engine's
        ``ModelRunner``, typed ``Any``: this package sits below the engine)."""
        if not isinstance(runner.backend, PlanCapture):
            runner.backend = PlanCapture(runner.backend)

    @property
    def failure(self) -> str | None:
        """Why the group is down, or None."""
        return self.group.failure

    def close(self) -> None:
        """Stop the workers and leave the group."""
        self.group.close()

    @torch.inference_mode()
    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        pool: KVPool,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Run the batch on every rank; same contract as :meth:`LlamaDecoder.forward`.

        Returns:
            fp32 logits ``[B, vocab_size]``.

        Raises:
            TPGroupError: when the group is down, or this step fails on any rank (a
                collective raised or timed out); the group is down afterwards.
        """
        if not isinstance(backend, PlanCapture) or backend.meta is None:
            raise RuntimeError("TPDecoder.bind(runner) was not called")
        meta = backend.meta
        ints = torch.cat([t.to(torch.int64) for t in step_tensors(meta, logit_rows)])
        head = StepHeader(
            tokens=embeds.shape[0],
            ints=tuple(t.numel() for t in step_tensors(meta, logit_rows)),
            seq_lens=tuple(meta.seq_lens),
            extend_lens=tuple(meta.extend_lens),
            is_decode=meta.is_decode,
        )
        self.group.send_step(head)  # raises at once when the group is down
        try:
            dist.broadcast(embeds.contiguous(), src=0)
            dist.broadcast(ints, src=0)
            local = super().forward(embeds, positions, backend, pool, logit_rows)
            logits = gather_logits(local, self.layout)
        except Exception as exc:
            # the ranks are out of step now: nothing can run on this group again
            self.group.fail(f"step failed on rank 0: {type(exc).__name__}: {exc}")
            raise TPGroupError(self.group.failure) from exc
        assert logits is not None  # rank 0 gathers every rank's slice
        return logits


def load_tp_model(config: EngineConfig) -> LoadedModel:
    """Start ``config.tp - 1`` worker ranks and load rank 0's model: the front end,
    the vision side and rank 0's decoder shard (with the whole embedding).

    Args:
        config: engine settings; ``model_path`` names the checkpoint.

    Returns:
        A :class:`LoadedModel` whose ``decoder`` is a :class:`TPDecoder`.

    Raises:
        ValueError: for a ``tp`` the model or machine cannot run (see :func:`check_tp`),
            or ``deterministic`` with quantized weights.
        CheckpointError: as :func:`~mmserve.model.loader.load_model`.
        TPGroupError: when a worker fails to start.
    """
    assert config.model_path is not None, "a tensor-parallel model needs a model_path"
    model_dir = Path(config.model_path)
    hf_config, processor, family = read_front_end(model_dir)
    shape = text_shape(hf_config)
    stored = checkpoint_method(getattr(hf_config, "quantization_config", None))
    method = resolve_method(
        config.quantization, stored, getattr(hf_config, "quantization_config", None)
    )
    check_quantization(method, config.device)  # before any rank starts
    check_tp(shape, config.tp, config.device, config.deterministic)
    if config.deterministic and method != "none":
        raise ValueError(
            f"--deterministic with --tp {config.tp} runs unquantized weights only: the "
            f"{method} row-parallel layers sum their ranks' rounded partials "
            "(use --tp 1, or no --quantization)"
        )
    dtype = config.torch_dtype()
    device = rank_device(config.device, 0)
    group = TPGroup(config, model_dir, shape, dtype)
    try:
        decoder = TPDecoder(TPLayout(0, config.tp, shape), group)
        decoder.load(model_dir, device, dtype, method)
        vision = load_vision(model_dir, family, dtype, device)
        group.join()
    except BaseException:
        group.close()
        raise
    loaded = assemble(model_dir, hf_config, processor, family, decoder, vision)
    loaded.quantization = method
    loaded.quantization_source = quantization_source(config.quantization, stored)
    return loaded
