"""``--dtype auto`` on CPUs with and without native bf16, and the KV pool sized from
memory (``--kv-cache-memory``, ``--mem-fraction-static``, ``--max-total-tokens``)."""

from __future__ import annotations

import logging

import pytest
import torch

from mmserve.cache.kv_pool import KVPool, kv_bytes_per_token, plan_pool
from mmserve.config import DEFAULT_MAX_TOTAL_TOKENS, EngineConfig, auto_dtype, cpu_bf16_flags

SPR = "processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
OLD = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
GIB = 1 << 30


def test_auto_dtype_follows_the_cpu_flags() -> None:
    assert cpu_bf16_flags(SPR) == ["avx512_bf16", "amx_bf16"]
    assert cpu_bf16_flags(OLD) == []
    name, why = auto_dtype("cpu", SPR)
    assert name == "bfloat16" and "avx512_bf16" in why
    name, why = auto_dtype("cpu", OLD)
    assert name == "float32" and "no native bf16" in why
    assert auto_dtype("cuda", OLD)[0] == "bfloat16"


def test_config_auto_dtype_on_this_cpu() -> None:
    with open("/proc/cpuinfo") as f:
        native = any(flag in f.read() for flag in ("avx512_bf16", "amx_bf16"))
    want = torch.bfloat16 if native else torch.float32
    assert EngineConfig(dtype="auto").torch_dtype() == want
    assert EngineConfig(dtype="float32").torch_dtype() == torch.float32


def test_bytes_per_token_of_onevision_05b() -> None:
    # Qwen2-0.5B: 24 layers, 2 K/V heads of 64: 12 KiB per token in bf16
    assert kv_bytes_per_token(24, 2, 64, torch.bfloat16) == 12288
    # LLaVA-NeXT-7B (Vicuna): 32 layers, 32 heads of 128: 512 KiB per token in fp16
    assert kv_bytes_per_token(32, 32, 128, torch.float16) == 512 * 1024


def test_pool_from_kv_cache_memory_and_fraction() -> None:
    bpt = 12288
    cfg = EngineConfig(kv_cache_memory=GIB, page_size=16)
    plan = plan_pool(cfg, bpt, 32768, memory=(8 * GIB, 16 * GIB))
    assert plan.tokens == GIB // bpt // 16 * 16 == 87376
    assert plan.bytes <= GIB and "--kv-cache-memory" in plan.reason
    # SGLang's rule: available after the weights minus what the fraction keeps free
    cfg = EngineConfig(mem_fraction_static=0.5)
    plan = plan_pool(cfg, bpt, 32768, memory=(10 * GIB, 16 * GIB))
    assert plan.tokens == (10 * GIB - 8 * GIB) // bpt
    # an explicit token count wins; nothing given keeps the default
    assert (
        plan_pool(EngineConfig(max_total_tokens=4096, kv_cache_memory=GIB), bpt, 32768).tokens
        == 4096
    )
    assert plan_pool(EngineConfig(), bpt, 32768).tokens == DEFAULT_MAX_TOTAL_TOKENS


def test_pool_too_small_for_one_request_is_refused_with_numbers() -> None:
    with pytest.raises(ValueError) as ei:
        plan_pool(EngineConfig(mem_fraction_static=0.5), 12288, 32768, memory=(7 * GIB, 15 * GIB))
    msg = str(ei.value)
    assert "0 tokens" in msg and "32768 tokens" in msg and "12288 bytes per token" in msg
    with pytest.raises(ValueError, match="one request of the model's context"):
        plan_pool(EngineConfig(kv_cache_memory=100 * 12288), 12288, 32768, memory=(GIB, GIB))
    with pytest.raises(ValueError, match="only 1.00 GiB .* available"):
        plan_pool(EngineConfig(kv_cache_memory=2 * GIB), 12288, 4096, memory=(GIB, 4 * GIB))


@pytest.mark.parametrize(
    "kw",
    [
        {"kv_cache_memory": 0},
        {"mem_fraction_static": 1.5},
        {"kv_cache_memory": 1, "mem_fraction_static": 0.5},
    ],
)
def test_config_rejects_bad_budgets(kw: dict) -> None:
    with pytest.raises(ValueError):
        EngineConfig(**kw).validate()


def test_engine_pool_from_memory_logs_tokens_and_bytes(loaded, caplog) -> None:
    from mmserve.frontend.frontend import Engine

    shape = loaded.decoder.shape
    bpt = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, torch.float32)
    budget = (shape.max_position_embeddings + 100) * bpt
    with caplog.at_level(logging.DEBUG, logger="mmserve.cache.kv_pool"):
        engine = Engine(EngineConfig(kv_cache_memory=budget, dtype="float32"), model=loaded)
    assert engine.pool.size_tokens == budget // bpt
    assert isinstance(engine.pool, KVPool)
    text = caplog.text
    assert f"KV pool {budget // bpt} tokens" in text and f"{bpt} bytes per token" in text
