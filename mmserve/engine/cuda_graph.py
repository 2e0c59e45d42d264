"""Decode batches padded to a bucket and replayed from CUDA graphs captured at start-up.

At batch 1-32 a decode step of a small model is bound by launching its few hundred
kernels from Python, not by the GPU; a CUDA graph launches them all at once. A graph
replays fixed kernels on fixed addresses, so the runner keeps static input buffers
(:class:`~mmserve.kernels.metadata.PaddedDecodeBuffers`: token ids, positions, K/V slots,
page table) and captures one graph per bucket (:func:`capture_sizes`: 1, 2, 4, 8, 16,
24, 32, ...). A decode batch of ``B`` requests is padded to the smallest bucket
``>= B``: the padding rows are one-token sequences on the pool's scratch page
(:attr:`~mmserve.cache.kv_pool.KVPool.scratch_page`), which no request owns, so they
write no page a real request reads. Before each replay the buffers are refilled and the
attention backend re-planned into its own fixed buffers (FlashInfer's ``use_cuda_graph``
decode wrappers); the graph computes embeddings, the decoder and the LM head into a
static fp32 logits buffer, whose first ``B`` rows are the batch's. One buffer of the
largest bucket's rows serves every bucket (each writes its leading rows): a buffer per
bucket would hold ``sum(buckets) x vocab x 4`` bytes (~2.6 GB at a 152k vocabulary with
buckets up to 256) where one holds ``max_bs x vocab x 4`` (~156 MB).

The padded path is not CUDA-only: where nothing is captured (the CPU, or a backend whose
kernels cannot be captured) the same runner fills the same buffers and runs the
padded batch eagerly (the CPU twin, ``EngineConfig.cuda_graph_twin``), which is how the
tests pin its tokens to the eager path's. Prefill and mixed steps always run eagerly, and
so does speculative decoding's verify step (:mod:`mmserve.engine.spec_decode`: ``1 + k``
tokens per drafted request, through the prefill path); a step in which no request has a
draft is an ordinary decode step and uses the buckets.

The design follows SGLang's ``CudaGraphRunner`` (bucket list and default largest bucket
by GPU memory: ``python/sglang/srt/server_args.py``) and FlashInfer's CUDA-graph decode
(``BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True, paged_kv_*_buffer=...)``).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch

from mmserve.cache.kv_pool import KVPool
from mmserve.config import EngineConfig
from mmserve.kernels.backend import AttentionBackend
from mmserve.kernels.metadata import PaddedDecodeBuffers
from mmserve.model.llama import DecoderStack, token_embedding

log = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    """The buckets up to ``max_bs``: 1, 2, 4, 8, then every 8 up to 256, every 16 up to
    512, every 32 beyond (SGLang's list without its 12), and ``max_bs`` itself.

    Raises:
        ValueError: ``max_bs < 1``.
    """
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    sizes = [1, 2, 4, 8, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    sizes = [b for b in sizes if b <= max_bs]
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def default_max_bs(device: torch.device | str, total_memory: int | None = None) -> int:
    """The largest bucket by the device's memory, SGLang's rule for one or two GPUs:
    under 20 GiB 8, under 35 GiB 24, under 60 GiB 32, else 256 (512 from 160 GiB);
    160 where the memory is unknown (the CPU: the twin pads to the same buckets).

    Args:
        device: the model's device.
        total_memory: the device's memory in bytes (read from CUDA when None).
    """
    dev = torch.device(device)
    if total_memory is None:
        if dev.type != "cuda":
            return 160
        total_memory = torch.cuda.get_device_properties(dev).total_memory
    gib = total_memory / 2**30
    for limit, bs in ((20, 8), (35, 24), (60, 32), (160, 256)):
        if gib < limit:
            return bs
    return 512


def graph_mode(config: EngineConfig, backend: AttentionBackend) -> tuple[int, bool, str]:
    """How an engine runs decode: ``(max_bs, capture, why)``; ``max_bs`` 0 means eager.

    Captured on CUDA with a backend that ``captures_graphs`` (FlashInfer) at ``tp`` 1,
    unless ``disable_cuda_graph``; padded without capture where ``cuda_graph_twin`` asks
    and nothing can be captured. ``max_bs``: ``cuda_graph_max_bs``, else
    :func:`default_max_bs`, capped at ``max_running_requests``.
    """
    if config.disable_cuda_graph:
        return 0, False, "--disable-cuda-graph"
    if config.tp > 1:
        return 0, False, "tensor parallelism (tp > 1) decodes eagerly"
    device = torch.device(config.device)
    capture = device.type == "cuda" and backend.captures_graphs
    if not capture and not config.cuda_graph_twin:
        why = (
            f"the {backend.name} attention backend cannot be captured"
            if device.type == "cuda"
            else "no CUDA device"
        )
        return 0, False, why
    max_bs = config.cuda_graph_max_bs or default_max_bs(device)
    max_bs = min(max_bs, config.max_running_requests)
    why = "captured" if capture else "padded without capture (cuda_graph_twin)"
    return max_bs, capture, why


class DecodeGraphRunner:
    """Runs decode batches padded to a bucket, from captured CUDA graphs where it can.

    Args:
        decoder: the :class:`~mmserve.model.llama.LlamaDecoder` (called as
            ``decoder(embeds, positions, backend, pool, logit_rows)``).
        backend: the attention backend (planned through
            :meth:`~mmserve.kernels.backend.AttentionBackend.plan_padded`).
        pool: the KV pool (its scratch page takes the padding rows' K/V).
        logit_mask: fp32 ``[vocab]`` added to every logits row (never-sampled ids at -inf).
        max_bs: the largest bucket (requests); larger batches are not this runner's.
        max_context: longest sequence a request may reach (tokens); sizes the page table.
        capture: capture one CUDA graph per bucket (needs CUDA and a backend with
            ``captures_graphs``); False runs the padded batch eagerly (the CPU twin).

    Attributes:
        buckets: the batch sizes (:func:`capture_sizes`); max_bs: the largest.
        buffers: the static inputs (:class:`~mmserve.kernels.metadata.PaddedDecodeBuffers`).
        logits: the shared fp32 logits buffer ``[max_bs, vocab]`` every bucket writes
            its leading rows of (captured or not).
        graphs: bucket -> captured graph (empty without capture); outputs: bucket ->
            its logits, ``logits[:bucket]`` (a view: no bucket owns a buffer of its own).
        capture_seconds: wall time of :meth:`capture` (0 before or without it).
        capture_bytes: device memory the graphs took (bytes; 0 without capture).
        replays: padded batches run so far (captured or eager), by bucket in
            ``replays_by_bucket``.
    """

    def __init__(
        self,
        decoder: DecoderStack,
        backend: AttentionBackend,
        pool: KVPool,
        logit_mask: torch.Tensor,
        max_bs: int,
        max_context: int,
        capture: bool,
    ) -> None:
        self.decoder = decoder
        self.backend = backend
        self.pool = pool
        self.logit_mask = logit_mask
        self.buckets = capture_sizes(max_bs)
        self.max_bs = self.buckets[-1]
        self.device = logit_mask.device
        P = pool.page_size
        self.buffers = PaddedDecodeBuffers(
            self.max_bs, -(-max_context // P), P, pool.scratch_page, self.device
        )
        self.capture_enabled = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits = torch.empty(
            self.max_bs, logit_mask.shape[-1], dtype=torch.float32, device=self.device
        )
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.replays = 0
        self.replays_by_bucket: dict[int, int] = {}

    def bucket(self, batch_size: int) -> int | None:
        """The smallest bucket holding ``batch_size`` requests, or None when too large."""
        i = bisect.bisect_left(self.buckets, batch_size)
        return self.buckets[i] if i < len(self.buckets) else None

    @torch.inference_mode()
    def _forward(self, bucket: int) -> torch.Tensor:
        """The padded batch's logits ``[bucket, vocab]`` fp32 from the static buffers
        (what a graph captures: embedding, decoder, LM head, logit mask), written into
        the shared buffer's leading rows (``outputs[bucket]``)."""
        b = self.buffers
        embeds = token_embedding(self.decoder)(b.input_ids[:bucket])
        logits = self.decoder(
            embeds, b.positions[:bucket], self.backend, self.pool, b.logit_rows[:bucket]
        )
        out = self.outputs.setdefault(bucket, self.logits[:bucket])
        return torch.add(logits, self.logit_mask, out=out)

    def _fill(
        self, page_tables: Sequence, seq_lens: Sequence[int], ids: Sequence[int], bucket: int
    ):
        meta = self.buffers.fill(page_tables, seq_lens, ids, bucket)
        self.backend.plan_padded(meta)
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first so that smaller ones reuse its
        memory pool; every bucket runs on padding rows only (the scratch page). Logs the
        time and the device memory taken. A no-op without ``capture``.

        Raises:
            RuntimeError: a bucket failed to capture (the message names the way out,
                ``--disable-cuda-graph``).
        """
        if not self.capture_enabled:
            return
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bucket in reversed(self.buckets):
            torch.cuda.synchronize(self.device)  # the host buffers' last copies are done
            self._fill([], [], [], bucket)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            try:
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up: lazy inits, allocator state, JIT builds
                        self._forward(bucket)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool, stream=stream):
                    self._forward(bucket)
            except Exception as e:
                raise RuntimeError(
                    f"CUDA graph capture of decode batch size {bucket} failed "
                    f"({type(e).__name__}: {e}); run with --disable-cuda-graph"
                ) from e
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        log.info(
            "CUDA graphs: captured %d decode batch sizes (%s) in %.1f s, %.0f MiB",
            len(self.buckets), ",".join(map(str, self.buckets)), self.capture_seconds,
            self.capture_bytes / 2**20,
        )  # fmt: skip

    @torch.inference_mode()
    def run(
        self, page_tables: Sequence, seq_lens: Sequence[int], token_ids: Sequence[int]
    ) -> torch.Tensor:
        """One decode step of ``B`` requests, padded to their bucket.

        Args:
            page_tables: per request, its pages (covering ``seq_len`` tokens).
            seq_lens: per request, its KV length after this step (tokens).
            token_ids: per request, the token this step computes K/V and logits for.

        Returns:
            fp32 logits ``[B, vocab]`` (never-sampled ids at -inf): a new tensor, so the
            next replay does not overwrite them.

        Raises:
            ValueError: ``B`` over the largest bucket, or a request longer than the page
                table holds (as :meth:`PaddedDecodeBuffers.fill`).
        """
        n = len(seq_lens)
        bucket = self.bucket(n)
        if bucket is None:
            raise ValueError(f"a decode batch of {n} exceeds the largest bucket {self.max_bs}")
        self._fill(page_tables, seq_lens, token_ids, bucket)
        self.replays += 1
        self.replays_by_bucket[bucket] = self.replays_by_bucket.get(bucket, 0) + 1
        graph = self.graphs.get(bucket)
        if graph is None:
            return self._forward(bucket)[:n].clone()
        graph.replay()
        return self.outputs[bucket][:n].clone()
