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
#: Accepted values of ``EngineConfig.dtype`` / ``--dtype``.
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: Accepted values of ``EngineConfig.attention_backend`` / ``--attention-backend``
#: (resolved by :func:`mmserve.kernels.select.resolve_attention_backend`).
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")


@dataclass
class EngineConfig:
    """Settings of one :class:`~mmserve.engine.engine.Engine`.

    Attributes:
        model_path: checkpoint directory (None: build/use the bundled tiny model).
        device: torch device ("cpu" or "cuda").
        dtype: weights, activations and KV pool dtype: "auto" (bfloat16 on CUDA and on
            a CPU with native bf16 arithmetic, AVX512-BF16 or AMX-BF16; float32 on other
            CPUs: see :func:`auto_dtype`), "float32", "bfloat16" or "float16".
        attention_backend: "auto" (FlashInfer where it can run, else torch),
            "torch" or "flashinfer" (see :mod:`mmserve.kernels.select`).
        page_size: tokens per KV page.
        max_total_tokens: KV pool capacity in tokens (rounded down to whole pages); an
            explicit value overrides the memory-based sizing. None: sized from
            ``kv_cache_memory`` or ``mem_fraction_static`` when one is set, else
            :data:`DEFAULT_MAX_TOTAL_TOKENS` (see :func:`mmserve.cache.kv_pool.plan_pool`).
        kv_cache_memory: bytes for the K/V pool (vLLM's ``--kv-cache-memory``); the pool
            holds ``kv_cache_memory // bytes per token`` tokens.
        mem_fraction_static: fraction of the device's total memory (RAM on CPU, GPU
            memory on CUDA) that weights plus K/V pool may take, as SGLang's flag: the pool
            gets what is free after loading the weights minus ``(1 - fraction) x total``.
        max_running_requests: most requests decoding at once.
        max_prefill_tokens: new-token budget of one prefill step (tokens); a longer
            prompt is prefilled in chunks of at most this many tokens.
        max_num_batched_tokens: most tokens one mixed step computes (tokens): every
            running request's decode token, then prefill chunks of waiting requests in
            what is left (at most ``max_prefill_tokens``), so a long prompt delays the
            running streams by one chunk's time per step, not by its whole prefill
            (vLLM's chunked prefill with the same name).
        disable_mixed_steps: run each step as either a prefill batch or a decode batch
            (prefill first), as before mixed steps; for comparison and debugging.
        disable_radix_cache: never reuse KV across requests (SGLang's flag).
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
        disable_jump_forward: decode structured output token by token even where the
            grammar allows only one continuation (jump-forward decoding off).
    """

    model_path: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    attention_backend: str = "auto"
    page_size: int = 1
    max_total_tokens: int | None = None
    kv_cache_memory: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    max_num_batched_tokens: int = 2048
    disable_mixed_steps: bool = False
    disable_radix_cache: bool = False
    policy: str = "lpm"
    decode_reserve_ratio: float = 0.6
    max_wait_seconds: float = 30.0
    policy_seed: int = 0
    vision_cache_bytes: int = 256 << 20
    max_image_tokens_per_request: int = 16384
    max_images_per_request: int = 8
    dedup_min_tokens: int = 32
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    disable_jump_forward: bool = False

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
        if self.max_running_requests < 1 or self.max_prefill_tokens < 1:
            raise ValueError("max_running_requests and max_prefill_tokens must be >= 1")
        if self.max_num_batched_tokens < 2:
            raise ValueError("max_num_batched_tokens must be >= 2 (a decode and a prefill token)")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {self.attention_backend!r}; "
                f"choose one of {', '.join(ATTENTION_BACKENDS)}"
            )

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
