"""Worker ranks 1..N-1 of a tensor-parallel group, and the step protocol they share
with rank 0 (:mod:`mmserve.distributed.group`).

Imports stay light (no transformers): a worker needs torch, its shard and a KV pool.
Every step: a :class:`StepHeader` arrives on the pipe, then two broadcasts from rank 0
(embeddings ``[T, hidden]`` in the model dtype; the attention metadata and logit rows
as one int64 tensor), then the rank's shard runs, then the padded vocabulary slices of
the logits are gathered on rank 0.
"""

from __future__ import annotations

import datetime
import multiprocessing.connection
import os
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mmserve.cache.kv_pool import KVPool
from mmserve.distributed.layout import TPLayout
from mmserve.distributed.shard import ShardedDecoder
from mmserve.kernels.metadata import AttentionMetadata
from mmserve.kernels.select import make_attention_backend
from mmserve.model import quant_onednn
from mmserve.model.llama import LlamaShape


def rank_device(device: str, rank: int) -> str:
    """Device of ``rank``: ``cuda:rank`` on CUDA, else ``device``."""
    return f"cuda:{rank}" if device.startswith("cuda") else device


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to load its shard and join (picklable; spawn hands it over)."""

    rank: int
    world: int
    port: int
    model_dir: str
    shape: LlamaShape
    device: str
    dtype: torch.dtype
    attention_backend: str
    quantization: str
    num_pages: int
    page_size: int
    timeout_s: float
    threads: int
    deterministic: bool = False
    disable_int8_onednn: bool = False


@dataclass(frozen=True)
class StepHeader:
    """A step's shapes, sent over the pipe before its tensors are broadcast.

    Attributes:
        tokens: new tokens ``T`` of the batch (rows of the embeddings).
        ints: lengths of the int64 pieces, in order: qo_indptr, kv_indptr, kv_indices,
            kv_last_page_len, out_cache_loc, positions, logit_rows.
        seq_lens, extend_lens: per request (tokens).
        is_decode: every request has one new token.
    """

    tokens: int
    ints: tuple[int, ...]
    seq_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    is_decode: bool


def step_tensors(meta: AttentionMetadata, logit_rows: torch.Tensor) -> list[torch.Tensor]:
    """The integer tensors of a step in :attr:`StepHeader.ints` order (int32 or int64)."""
    return [
        meta.qo_indptr,
        meta.kv_indptr,
        meta.kv_indices,
        meta.kv_last_page_len,
        meta.out_cache_loc,
        meta.positions,
        logit_rows,
    ]


def unpack_step(
    head: StepHeader, ints: torch.Tensor, page_size: int
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Rebuild a step's metadata and int64 logit rows ``[B]`` from the broadcast int64
    tensor ``ints`` (the :func:`step_tensors` concatenated) and its header."""
    parts = list(torch.split(ints, list(head.ints)))
    i32 = [p.to(torch.int32) for p in parts[:4]]
    meta = AttentionMetadata(
        qo_indptr=i32[0],
        kv_indptr=i32[1],
        kv_indices=i32[2],
        kv_last_page_len=i32[3],
        page_size=page_size,
        out_cache_loc=parts[4],
        positions=parts[5],
        seq_lens=list(head.seq_lens),
        extend_lens=list(head.extend_lens),
        is_decode=head.is_decode,
    )
    return meta, parts[6]


def gather_logits(local: torch.Tensor, layout: TPLayout) -> torch.Tensor | None:
    """Rank 0: ``[B, V]`` logits from every rank's ``[B, vocab_rows]`` slice (each padded
    to ``vocab_per_rank`` columns for the gather); others: None."""
    pad = layout.vocab_per_rank - local.shape[1]
    local = F.pad(local, (0, pad)) if pad else local
    if layout.rank != 0:
        dist.gather(local, None, dst=0)
        return None
    parts = [torch.empty_like(local) for _ in range(layout.world)]
    dist.gather(local, parts, dst=0)
    return torch.cat(parts, dim=1)[:, : layout.full.vocab_size]


def init_group(spec: WorkerSpec, store: dist.Store) -> None:
    """Join the default process group (gloo on CPU, NCCL on CUDA) with ``spec``'s timeout
    on every collective.

    Raises:
        RuntimeError (torch.distributed): when the other ranks do not join in time.
    """
    backend = "nccl" if spec.device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        store=store,
        rank=spec.rank,
        world_size=spec.world,
        timeout=datetime.timedelta(seconds=spec.timeout_s),
    )


def _watch_parent(parent: int) -> None:
    """Exit this worker once its parent is gone (it was re-parented)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def worker_main(spec: WorkerSpec, conn: multiprocessing.connection.Connection, parent: int) -> None:
    """Entry point of ranks 1..N-1 (spawned by :class:`TPGroup`).

    Loads the rank's shard, reports ``("loaded", weight_bytes)`` (or ``("error", text)``)
    on ``conn``, joins the group, then runs one step per header received until it
    receives None or the pipe closes.
    """
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(spec.threads)
    try:
        device = rank_device(spec.device, spec.rank)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        quant_onednn.enable(not spec.disable_int8_onednn)
        layout = TPLayout(spec.rank, spec.world, spec.shape)
        decoder = ShardedDecoder(layout, with_embedding=False)
        decoder.load(Path(spec.model_dir), device, spec.dtype, spec.quantization)
        shape = decoder.shape
        pool = KVPool(
            spec.num_pages,
            spec.page_size,
            shape.num_layers,
            shape.num_kv_heads,
            shape.head_dim,
            dtype=spec.dtype,
            device=device,
        )
        backend = make_attention_backend(
            spec.attention_backend,
            device,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            spec.dtype,
            deterministic=spec.deterministic,
        )
        conn.send(("loaded", decoder.weight_bytes()))
        store = dist.TCPStore(
            "127.0.0.1",
            spec.port,
            spec.world,
            is_master=False,
            timeout=datetime.timedelta(seconds=spec.timeout_s),
        )
        init_group(spec, store)
    except Exception:  # noqa: BLE001 - reported to rank 0, which raises it at start-up
        conn.send(("error", traceback.format_exc()))
        return
    hidden = layout.full.hidden_size
    try:
        while True:
            try:
                head = conn.recv()
            except EOFError:  # rank 0 is gone
                break
            if head is None:
                break
            embeds = torch.empty(head.tokens, hidden, dtype=spec.dtype, device=device)
            ints = torch.empty(sum(head.ints), dtype=torch.int64, device=device)
            dist.broadcast(embeds, src=0)
            dist.broadcast(ints, src=0)
            meta, rows = unpack_step(head, ints, spec.page_size)
            backend.plan(meta)
            local = decoder(embeds, meta.positions, backend, pool, rows)
            gather_logits(local, layout)
    except Exception:  # noqa: BLE001 - tell rank 0 why, then exit; rank 0 fails the step
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
