"""Engine knobs in one dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mmserve.vision.image import ImageLimits

if TYPE_CHECKING:
    import torch

#: Waiting-queue orders (``EngineConfig.policy`` / ``--policy``).
POLICIES = ("lpm", "dfs-weight", "fcfs", "random")
#: KV pool tokens when neither a token count nor a memory budget is given.
DEFAULT_MAX_TOTAL_TOKENS = 32768


def pool_tokens(config: EngineConfig) -> int:
    """The KV pool's tokens without a memory budget: ``max_total_tokens``, else
    :data:`DEFAULT_MAX_TOTAL_TOKENS` (what every tensor-parallel rank allocates)."""
    return config.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS


#: Accepted values of ``EngineConfig.quantization`` / ``--quantization``
#: (:mod:`mmserve.model.quant`).
QUANTIZATIONS = ("none", "int8", "int4", "fp8")
#: vLLM's ``--quantization`` names of a quantized checkpoint's format, also accepted: the
#: checkpoint is served in its own method, and refused when it is not in that format
#: (:func:`mmserve.model.quant.resolve_method`).
CHECKPOINT_QUANTIZATIONS = ("awq", "gptq", "compressed-tensors")
#: Accepted values of ``EngineConfig.kv_write_policy`` / ``--kv-write-policy`` (SGLang's
#: HiCache names): when the disk KV tier gets a page.
KV_WRITE_POLICIES = ("write_back", "write_through")
#: Accepted values of ``EngineConfig.dtype`` / ``--dtype``.
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: Accepted values of ``EngineConfig.attention_backend`` / ``--attention-backend``
#: (resolved by :func:`mmserve.kernels.select.resolve_attention_backend`).
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
#: Accepted values of ``EngineConfig.kv_cache_dtype`` / ``--kv-cache-dtype``: "auto" stores
#: K/V in the model's dtype; "fp8_e4m3" (alias "fp8", as vLLM) in float8_e4m3fn with
#: per-layer scales (:mod:`mmserve.cache.kv_pool`).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8")
#: Accepted values of ``EngineConfig.speculative`` / ``--speculative``
#: (:mod:`mmserve.engine.spec_decode`).
SPECULATIVE_METHODS = ("off", "ngram")


@dataclass
class EngineConfig:
    """Settings of one :class:`~mmserve.frontend.frontend.Engine`.

    Attributes:
        model_path: checkpoint directory (a Hugging Face LLaVA-family model) or a Hugging
            Face Hub id (``org/name``, fetched into the Hub cache: see
            :mod:`mmserve.model.hub`); without it, ``mmserve serve`` runs the bundled tiny
            model, for trying things out.
        revision: branch, tag or commit of a Hub id ``model_path`` (unset: "main").
        download_dir: Hub cache folder for a Hub id ``model_path`` (unset: ``HF_HUB_CACHE``,
            else ``HF_HOME/hub``).
        device: torch device ("cpu" or "cuda").
        dtype: weights, activations and KV pool dtype: "auto" (bfloat16 on CUDA and on
            a CPU with native bf16 arithmetic, AVX512-BF16 or AMX-BF16; float32 on other
            CPUs: see :func:`auto_dtype`), "float32", "bfloat16" or "float16".
        quantization: the decoder's linear weights quantized at load: "none", "int8"
            (weight-only, per output channel; activations in ``dtype``), "int4" (weight-
            only, groups of 128 input features: :mod:`mmserve.model.int4`) or "fp8" (e4m3
            weights and per-token activations, CUDA with compute capability >= 8.9 only);
            a quantized checkpoint (compressed-tensors, AWQ, GPTQ) is served in its own
            method (see :mod:`mmserve.model.quant`), with "none" or with its format's
            name ("awq", "gptq", "compressed-tensors": refused for a checkpoint in
            another format, as vLLM's flag).
        disable_int8_onednn: int8 weights on an AVX-512 CPU keep no oneDNN prepacked
            copy. By default they do: it runs batches of more than 4 rows (decode batches,
            prefill) about 1.6x faster with the same results
            (:mod:`mmserve.model.quant_onednn`) and doubles int8's weight memory (about
            bf16's); disabled, int8 weights take half of bf16's and those batches run
            ``torch._int_mm``.
        attention_backend: "auto" (FlashInfer where it can run, else torch),
            "torch" or "flashinfer" (see :mod:`mmserve.kernels.select`); the fused
            RMSNorm, RoPE and SiLU-and-mul ops follow it: FlashInfer's kernels only with
            the FlashInfer backend, so "torch" runs no FlashInfer kernel at all.
        kv_cache_dtype: K/V pool storage (:data:`KV_CACHE_DTYPES`): "auto" (the model's
            dtype, or fp8 when the checkpoint's compressed-tensors ``kv_cache_scheme``
            asks for it) or "fp8_e4m3" (alias "fp8"): float8 e4m3 pages, one byte per
            element, so the same ``kv_cache_memory`` holds twice the tokens of bf16;
            written with per-layer K and V scales (the checkpoint's ``k_scale``/``v_scale``,
            else 1.0; the start-up log says which, and their range) and read by
            FlashInfer or upcast by the torch backend.
        page_size: tokens per KV page.
        max_total_tokens: KV pool capacity in tokens (rounded down to whole pages); an
            explicit value overrides the memory-based sizing. None: sized from
            ``kv_cache_memory`` or ``mem_fraction_static`` when one is set, else 32768
            tokens (:data:`DEFAULT_MAX_TOTAL_TOKENS`) (see
            :func:`mmserve.cache.kv_pool.plan_pool`).
        kv_cache_memory: bytes for the K/V pool (vLLM's ``--kv-cache-memory``); the pool
            holds this many bytes divided by the bytes one token's K and V take over all
            layers (whole tokens).
        mem_fraction_static: fraction of the device's total memory (RAM on CPU, GPU
            memory on CUDA) that weights plus K/V pool may take, as SGLang's flag: the pool
            gets what is free after loading the weights minus ``(1 - fraction) x total``.
        max_running_requests: most requests decoding at once.
        max_prefill_tokens: new-token budget of one prefill step (tokens); a longer
            prompt is prefilled in chunks of at most this many tokens.
        max_num_batched_tokens: most tokens one mixed step computes while requests are
            decoding (tokens): every running request's decode token, then prefill chunks
            of waiting requests in what is left (at most ``max_prefill_tokens``), so a
            long prompt delays the running streams by one chunk's time per step, not by
            its whole prefill (vLLM's chunked prefill with the same name). A step with
            nothing decoding prefills up to ``max_prefill_tokens``. 0 = by device: 2048
            on CUDA, 256 on the CPU (where a prefill token costs about as much as a
            decode step's share of a small batch, so 2048 would hold streams for
            seconds).
        background_prefill_tokens: most prompt tokens background requests (batch jobs)
            prefill in one step (tokens; see :attr:`EngineRequest.priority`); their prompts
            go in chunks this size, so a step running them stays short and an
            interactive request that arrives meanwhile waits at most one short step.
        disable_mixed_steps: run each step as either a prefill batch or a decode batch
            (prefill first), as before mixed steps; for comparison and debugging.
        disable_radix_cache: never reuse KV across requests (SGLang's flag).
        deterministic: batch- and chunk-invariant computation: the KV of a token and the
            logits of a step are bit-identical however the request was batched, chunked
            or split between cached prefix and fresh prefill, in every dtype (attention
            over fixed key blocks in the torch backend; see docs/architecture.md).
        policy: waiting-queue order (:data:`POLICIES`): "lpm" (longest prefix match
            first), "dfs-weight" (depth-first over the radix tree, heavier subtrees
            first), "fcfs" or "random". Cache-aware ones act as FCFS with the cache off.
        decode_reserve_ratio: fraction of a request's remaining ``max_tokens``
            whose pages are reserved at admission (1.0: every admitted request is
            sure to finish; lower admits more and retracts when decode runs dry).
        max_wait_seconds: a request waiting longer than this is admitted ahead of the
            policy's order (starvation guard).
        policy_seed: seed of the "random" policy.
        vision_cache_bytes: projected image embeddings kept, least recently used first
            out (bytes; 0 disables the cache).
        max_image_tokens_per_request: most image pseudo-tokens in one request (tokens);
            more gets a 400 that says how many each image needs, before any vision work.
        max_images_per_request: most images in one prompt.
        dedup_min_tokens: two waiting requests whose uncached parts share this many
            leading tokens are not prefilled in the same batch; the second waits
            one step and hits the cache instead.
        image_limits: byte and pixel limits for decoded images.
        max_request_image_pixels: most decoded pixels (width x height, every image and
            video frame) in one request; more gets a 400 naming the image that passes it,
            before that image is decoded.
        max_decoded_image_bytes: most bytes of decoded images (width x height x channels)
            that all requests hold at once while they are decoded and preprocessed.
        decoded_image_wait_seconds: how long a decode waits for room in
            ``max_decoded_image_bytes`` before the request gets a 503 with Retry-After.
        disable_jump_forward: decode structured output token by token even where the
            grammar allows only one continuation (jump-forward decoding off).
        kv_host_bytes: host-memory KV tier (bytes; 0 = off): pages the radix tree evicts
            are kept here, least recently used dropped first, and loaded back on a hit
            (pinned memory on CUDA; see :mod:`mmserve.cache.kv_tiers`).
        kv_disk_dir: disk KV tier directory (unset = off): evicted pages, and every
            cached page at shutdown, are written here, one checked file per page, in a
            subdirectory per model identity (a digest of every byte of the checkpoint's
            files, dtype, quantization), KV dtype and page size; servers sharing it reuse
            each other's pages, a restarted server its own.
        kv_disk_bytes: most bytes the disk KV tier keeps (least recently used deleted).
        kv_write_policy: when pages reach the disk KV tier: "write_back" (when the tree
            evicts them, and at shutdown) or "write_through" (also as every request ends,
            queued for the disk writer thread, as ``prompt_cache_retention: "24h"`` does for
            one request), so an engine process that is killed (no shutdown) leaves its
            cache on disk for the next one. Needs ``kv_disk_dir``.
        tp: tensor-parallel ranks: the decoder is split by heads and MLP columns over
            this many processes (one per GPU on CUDA, gloo on CPU); must divide the
            model's query heads (see :mod:`mmserve.distributed`).
        tp_timeout_seconds: bound on every tensor-parallel collective (seconds); a rank
            that dies or hangs longer fails the step's requests and takes the engine down.
        disable_cuda_graph: run decode eagerly on CUDA (SGLang's flag); by default decode
            batches are padded to a bucket and replayed from CUDA graphs captured at
            start-up (FlashInfer backend, ``tp`` 1; see :mod:`mmserve.engine.cuda_graph`).
        cuda_graph_max_bs: largest captured decode batch (requests); 0 = by GPU memory as
            SGLang (8 under 20 GiB ... 256 on 80-141 GiB), capped at
            ``max_running_requests``. Larger decode batches run eagerly.
        cuda_graph_twin: run decode through the graph runner's padded static buffers even
            where nothing is captured (the CPU, or the torch backend on CUDA): the CPU twin
            that tests hold token-equal to eager decode. Off by default (padding costs
            compute where launches are cheap); ``disable_cuda_graph`` wins.
        speculative: speculative decoding: "off", or "ngram" (prompt lookup: drafts
            copied from the request's own prompt and output, verified in one forward;
            greedy output unchanged, sampled output follows the same distribution; see
            :mod:`mmserve.engine.spec_decode`).
        num_speculative_tokens: most drafted tokens verified per request and step (1..16).
        ngram_min: shortest suffix n-gram looked up in the prompt and output (tokens, >= 1).
        ngram_max: longest suffix n-gram looked up (tokens, >= ngram_min, <= 16).
        speculative_max_batch: decode batches with more requests than this run without
            speculation (checking drafts stops paying once a step is bound by compute).
        speculative_min_accepted: a request whose drafts have had accepted tokens per
            verify below this, after its first ``speculative_window`` verifies, decodes
            without speculation from then on (tokens, >= 0; 0 never turns it off).
        speculative_window: verifies per request before ``speculative_min_accepted`` is
            checked (>= 1).
    """

    model_path: str | None = None
    revision: str | None = None
    download_dir: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    quantization: str = "none"
    disable_int8_onednn: bool = False
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    page_size: int = 1
    max_total_tokens: int | None = None
    kv_cache_memory: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    max_num_batched_tokens: int = 0
    background_prefill_tokens: int = 128
    disable_mixed_steps: bool = False
    disable_radix_cache: bool = False
    deterministic: bool = False
    policy: str = "lpm"
    decode_reserve_ratio: float = 0.6
    max_wait_seconds: float = 30.0
    policy_seed: int = 0
    vision_cache_bytes: int = 256 << 20
    max_image_tokens_per_request: int = 16384
    max_images_per_request: int = 8
    dedup_min_tokens: int = 32
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    max_request_image_pixels: int = 300_000_000
    max_decoded_image_bytes: int = 1 << 30
    decoded_image_wait_seconds: float = 5.0
    disable_jump_forward: bool = False
    kv_host_bytes: int = 0
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 16 << 30
    kv_write_policy: str = "write_back"
    tp: int = 1
    tp_timeout_seconds: float = 120.0
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 0
    cuda_graph_twin: bool = False
    speculative: str = "off"
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    speculative_max_batch: int = 4
    speculative_min_accepted: float = 0.3
    speculative_window: int = 8

    def mixed_step_tokens(self) -> int:
        """``max_num_batched_tokens`` with 0 resolved for ``device`` (tokens)."""
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        return 2048 if str(self.device).startswith("cuda") else 256

    def validate(self) -> None:
        """Raises ValueError for a setting out of range."""
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError("max_total_tokens must hold at least one page")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError("kv_cache_memory must be >= 1 byte")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError("mem_fraction_static must be in (0, 1]")
        if self.kv_cache_memory is not None and self.mem_fraction_static is not None:
            raise ValueError("give kv_cache_memory or mem_fraction_static, not both")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if not 0.0 <= self.decode_reserve_ratio <= 1.0:
            raise ValueError("decode_reserve_ratio must be in [0, 1]")
        if self.max_wait_seconds <= 0:
            raise ValueError("max_wait_seconds must be > 0")
        if self.vision_cache_bytes < 0 or self.max_image_tokens_per_request < 1:
            raise ValueError("vision_cache_bytes must be >= 0, max_image_tokens_per_request >= 1")
        if self.max_request_image_pixels < 1 or self.max_decoded_image_bytes < 1:
            raise ValueError("max_request_image_pixels and max_decoded_image_bytes must be >= 1")
        if self.decoded_image_wait_seconds < 0:
            raise ValueError("decoded_image_wait_seconds must be >= 0")
        if self.max_running_requests < 1 or self.max_prefill_tokens < 1:
            raise ValueError("max_running_requests and max_prefill_tokens must be >= 1")
        if self.background_prefill_tokens < 1:
            raise ValueError("background_prefill_tokens must be >= 1")
        if self.max_num_batched_tokens != 0 and self.max_num_batched_tokens < 2:
            raise ValueError(
                "max_num_batched_tokens must be 0 (by device) or >= 2 (a decode and a "
                "prefill token)"
            )
        if self.kv_host_bytes < 0 or self.kv_disk_bytes < 0:
            raise ValueError("kv_host_bytes and kv_disk_bytes must be >= 0")
        if self.kv_write_policy not in KV_WRITE_POLICIES:
            raise ValueError(
                f"unknown kv_write_policy {self.kv_write_policy!r}; "
                f"choose one of {', '.join(KV_WRITE_POLICIES)}"
            )
        if self.kv_write_policy == "write_through" and not self.kv_disk_dir:
            raise ValueError("--kv-write-policy write_through needs --kv-disk-dir")
        if self.tp < 1 or self.tp_timeout_seconds <= 0:
            raise ValueError("tp must be >= 1 and tp_timeout_seconds > 0")
        if self.tp > 1 and (self.kv_cache_memory is not None or self.mem_fraction_static):
            raise ValueError(
                "with tp > 1 size the KV pool with --max-total-tokens: --kv-cache-memory and "
                "--mem-fraction-static measure one process's memory, and every rank's pool "
                "must hold the same pages"
            )
        if self.cuda_graph_max_bs < 0:
            raise ValueError("cuda_graph_max_bs must be >= 0 (0: by GPU memory)")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}; choose one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        if self.kv_fp8() and self.tp > 1:
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype} is not supported with --tp > 1 yet; "
                "use --kv-cache-dtype auto with --tp, or --tp 1 with fp8 KV"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {self.attention_backend!r}; "
                f"choose one of {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.quantization not in QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS:
            raise ValueError(
                f"unknown quantization {self.quantization!r}; "
                f"choose one of {', '.join(QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS)}"
            )

        self._validate_speculative()

    def _validate_speculative(self) -> None:
        """Raises ValueError for a speculative-decoding setting out of range."""
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(
                f"unknown --speculative {self.speculative!r}; choose one of "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"--num-speculative-tokens must be in 1..16, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ValueError(
                "--ngram-min and --ngram-max must satisfy 1 <= ngram_min <= ngram_max <= 16, "
                f"got ngram_min {self.ngram_min}, ngram_max {self.ngram_max}"
            )
        if self.speculative_max_batch < 1 or self.speculative_window < 1:
            raise ValueError(
                "--speculative-max-batch and --speculative-window must be >= 1, got "
                f"{self.speculative_max_batch} and {self.speculative_window}"
            )
        if self.speculative_min_accepted < 0:
            raise ValueError(
                f"--speculative-min-accepted must be >= 0, got {self.speculative_min_accepted}"
            )

    def kv_fp8(self) -> bool:
        """Whether the KV pool stores float8 e4m3 (``kv_cache_dtype`` fp8_e4m3 or fp8)."""
        return self.kv_cache_dtype in ("fp8_e4m3", "fp8")

    def torch_dtype(self) -> torch.dtype:
        """The resolved model dtype: ``dtype``, with "auto" resolved by :func:`auto_dtype`.

        Raises:
            ValueError: for an unknown ``dtype`` string.
        """
        import torch  # here, so that importing the config (and the CLI) stays light

        if self.dtype == "auto":
            return getattr(torch, auto_dtype(self.device)[0])
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        return getattr(torch, self.dtype)


#: /proc/cpuinfo flags of native bf16 arithmetic (Intel Cooper Lake / Sapphire Rapids and
#: later, AMD Zen 4 and later): there oneDNN runs bf16 matmuls at twice the fp32 rate and
#: half the memory traffic; elsewhere bf16 is emulated and slower than fp32.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """The :data:`BF16_CPU_FLAGS` this CPU has (empty where none or unknown).

    Args:
        cpuinfo: text of ``/proc/cpuinfo`` (read when None; unreadable off Linux).
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read(1 << 20)  # the first processors' entries are enough
        except OSError:
            return []
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break
    return [f for f in BF16_CPU_FLAGS if f in flags]


def auto_dtype(device: str, cpuinfo: str | None = None) -> tuple[str, str]:
    """What ``--dtype auto`` means on ``device``, and why (for the start-up log).

    Returns:
        ``(dtype name, reason)``: "bfloat16" on CUDA and on a CPU with a flag of
        :data:`BF16_CPU_FLAGS`, else "float32".
    """
    import torch

    if torch.device(device).type == "cuda":
        return "bfloat16", "CUDA device"
    flags = cpu_bf16_flags(cpuinfo)
    if flags:
        return "bfloat16", f"the CPU has native bf16 ({', '.join(flags)})"
    return "float32", "the CPU has no native bf16 (no avx512_bf16 or amx_bf16 flag)"
