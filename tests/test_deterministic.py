"""Issue 46: under ``deterministic`` the greedy tokens and logprobs of a request are bit
for bit the same however it was cached, batched, chunked or paged, in bf16 (and fp16)."""

from __future__ import annotations

import pytest
import torch

from mmserve.config import EngineConfig
from mmserve.distributed.layout import check_tp
from mmserve.frontend.frontend import Engine
from mmserve.kernels.batch_invariant import (
    BLOCK_KEYS,
    attend_invariant,
    attend_invariant_decode,
    linear,
    reduction_splits,
    split_partials,
    tree_sum,
)
from mmserve.model.llama import LlamaShape
from mmserve.model.loader import load_model
from tests.helpers import QUESTIONS, check_against_reference, greedy, tp_engine, user


@pytest.fixture(scope="module")
def bf16(model_dir):
    """The tiny LLaVA-1.5 loaded in bfloat16, shared by this module's engines."""
    return load_model(model_dir, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def make_bf16(model_dir, bf16):
    def make(**kw) -> Engine:
        kw.setdefault("deterministic", True)
        cfg = EngineConfig(model_path=str(model_dir), dtype="bfloat16", **kw)
        return Engine(cfg, model=bf16)

    return make


@pytest.fixture(scope="module")
def img(make_bf16, photos):
    return make_bf16().processor.prepare_image(next(iter(photos.values())))


def _gen(eng: Engine, cases, n: int = 1, max_tokens: int = 5):
    """Greedy results of ``cases`` (``(messages, images)``, each ``n`` times) in one
    batch: per request ``(output_ids, chosen tokens' logprobs, each step's logits as
    bytes)``, so ``==`` is bit-for-bit equality."""
    params = greedy(max_tokens, logprobs=0)
    reqs = [
        eng.processor.make_request(messages=m, images=i, params=params)
        for m, i in cases
        for _ in range(n)
    ]
    out = []
    for r in eng.generate(reqs):
        logits = torch.stack(list(r.logits)).numpy().tobytes()
        out.append((list(r.output_ids), [t.logprob for t in r.logprobs], logits))
    eng.scheduler.check_accounting()
    return out


def _target(img):
    return (user(None, QUESTIONS[1]), [img])


def _others(img):
    return [
        (user(None, QUESTIONS[0]), [img]),
        (user("No image here, just text about a cat."), []),
        (user(None, QUESTIONS[2] + " Answer briefly."), [img]),
    ]


def test_attention_rows_do_not_depend_on_batch_or_key_count() -> None:
    torch.manual_seed(0)
    L, hq, hkv, d = 150, 4, 2, 16
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(L, hq, d).to(dtype)
        k, v = torch.randn(L, hkv, d).to(dtype), torch.randn(L, hkv, d).to(dtype)
        full = attend_invariant(q, k, v, torch.arange(L))
        for p in (0, 63, 64, 100, 149):  # a decode row alone, seeing only keys 0..p
            alone = attend_invariant(q[p : p + 1], k[: p + 1], v[: p + 1], torch.tensor([p]))
            assert torch.equal(alone[0], full[p]), (dtype, p)
        tail = attend_invariant(q[70:], k, v, torch.arange(70, L))  # a chunk after a cached 70
        assert torch.equal(tail, full[70:])
        # and it is attention: equal to the fp32 softmax within bf16 rounding
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1)[None],
            k.float().repeat_interleave(2, 1).transpose(0, 1)[None],
            v.float().repeat_interleave(2, 1).transpose(0, 1)[None],
            is_causal=True,
        )[0].transpose(0, 1)
        assert torch.allclose(full.float(), ref, atol=2e-2)
    assert BLOCK_KEYS == 64


def test_row_parallel_blocks_sum_to_the_same_bits_on_any_tp_size() -> None:
    """A rank's blocks tree-summed, gathered and tree-summed again give one rank's bits,
    for every power-of-two TP size, any row count; a plain sum of rounded rank partials
    (what an all-reduce adds) does not."""
    torch.manual_seed(0)
    t, k, out, splits = 9, 512, 96, 8
    x = torch.randn(t, k).bfloat16()
    w = (torch.randn(out, k) * 0.05).bfloat16()
    whole = split_partials(x, w, splits).bfloat16()
    assert torch.allclose(whole.float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-2)
    for rows in (1, 2, 5):  # a row's bits do not depend on the rows beside it
        assert torch.equal(split_partials(x[:rows].clone(), w, splits).bfloat16(), whole[:rows])
    for n in (2, 4, 8):
        cols = [slice(r * k // n, (r + 1) * k // n) for r in range(n)]
        ranks = [
            split_partials(x[:, c].contiguous(), w[:, c].contiguous(), splits // n) for c in cols
        ]
        assert torch.equal(tree_sum(ranks).bfloat16(), whole), n
    cols = [slice(0, k // 2), slice(k // 2, k)]
    reduced = sum(torch.nn.functional.linear(x[:, c], w[:, c]) for c in cols)
    assert not torch.equal(reduced, torch.nn.functional.linear(x, w))
    with pytest.raises(ValueError, match="power-of-two"):
        tree_sum([whole] * 3)


def test_a_single_row_gets_the_bits_it_gets_among_others() -> None:
    """A decode step alone has one row; on the CPU a one-row bf16 linear can take another
    kernel path. Under the flag every linear gives a row the bits it gets in any batch
    (the first case's plain one-row result differed on the avx512_bf16 CPU measured)."""
    for k, out, seed in ((1408, 512, 1408), (512, 768, 1), (896, 1152, 2)):
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(out, k, generator=g) * 0.02).bfloat16()
        x = torch.randn(33, k, generator=g).bfloat16()
        full = linear(x, w)
        assert torch.equal(full, torch.nn.functional.linear(x, w))  # many rows: unchanged
        for rows in (1, 2, 3, 8, 17):
            assert torch.equal(linear(x[:rows].clone(), w), full[:rows]), (k, out, rows)
        whole = split_partials(x, w, 8)
        assert torch.equal(split_partials(x[:1].clone(), w, 8), whole[:1])


def test_deterministic_tp_sizes_hold_whole_blocks() -> None:
    # 12 heads, MLP 96: blocks of 4 (the largest power of two <= 8 dividing both)
    shape = LlamaShape(101, 48, 96, 2, 12, 12, 4, 1e-6, 1e4, 128)
    assert reduction_splits(12, 96) == 4
    assert reduction_splits(14, 4864) == 2 and reduction_splits(32, 11008) == 8
    assert reduction_splits(7, 96) == 1
    for tp in (1, 2, 4):
        check_tp(shape, tp, deterministic=True)
    check_tp(shape, 3)  # fine without the flag
    with pytest.raises(ValueError, match=r"--tp 3 cannot run --deterministic.*choose --tp 1, 2, 4"):
        check_tp(shape, 3, deterministic=True)


def test_decode_rows_attended_together_equal_each_alone() -> None:
    """A decode batch's rows attend in one pass (requests of different lengths, so some
    get zero blocks after their row); each row keeps the bits it gets alone, and those
    of the same position in a prefill."""
    torch.manual_seed(1)
    hq, hkv, d = 4, 2, 16
    lens = [5, 64, 65, 200, 130, 1]
    ks = [torch.randn(n, hkv, d).bfloat16() for n in lens]
    vs = [torch.randn(n, hkv, d).bfloat16() for n in lens]
    q = torch.randn(len(lens), hq, d).bfloat16()
    together = attend_invariant_decode(q, ks, vs)
    for i, n in enumerate(lens):
        alone = attend_invariant(q[i : i + 1], ks[i], vs[i], torch.tensor([n - 1]))
        assert torch.equal(together[i], alone[0]), n
        qs = torch.randn(n, hq, d).bfloat16()
        qs[-1] = q[i]
        prefill = attend_invariant(qs, ks[i], vs[i], torch.arange(n))
        assert torch.equal(prefill[-1], together[i]), n


def test_cache_pages_and_chunking_change_no_bit(make_bf16, img) -> None:
    cases = [_target(img)]
    (base,) = _gen(make_bf16(disable_radix_cache=True, page_size=1), cases)
    # a warm cache: the image and most of the prompt cached by another question
    for cfg in (
        {"page_size": 1},
        {"page_size": 16},
        {"page_size": 1, "max_prefill_tokens": 37},
        {"page_size": 16, "max_prefill_tokens": 100},
        {"page_size": 1, "max_num_batched_tokens": 50, "max_prefill_tokens": 64},
    ):
        eng = make_bf16(**cfg)
        _gen(eng, _others(img)[:1])  # warms the cache with the same image, other question
        (warm,) = _gen(eng, cases)
        assert warm == base, cfg
        (again,) = _gen(eng, cases)  # now the whole prompt is cached
        assert again == base, cfg


def test_concurrent_equals_alone_and_n_choices(make_bf16, img) -> None:
    (alone,) = _gen(make_bf16(disable_radix_cache=True), [_target(img)])
    eng = make_bf16(max_num_batched_tokens=64, max_prefill_tokens=80)
    mixed = _gen(eng, [*_others(img), _target(img)])
    assert mixed[-1] == alone
    many = _gen(make_bf16(), [_target(img)], n=3)
    assert many == [alone] * 3


def test_without_the_flag_bf16_depends_on_the_cache(make_bf16, img) -> None:
    """The kind of fault the flag removes exists here: the torch backend's fast paths
    (view path, flash kernel splits by key count) round a cached and a fresh prefill
    differently in bf16, so some logprob differs."""
    cases = [_target(img)]
    (base,) = _gen(make_bf16(disable_radix_cache=True, deterministic=False), cases)
    differ = 0
    for cfg in ({"page_size": 1}, {"page_size": 1, "max_prefill_tokens": 37}):
        eng = make_bf16(deterministic=False, **cfg)
        _gen(eng, _others(img)[:1])
        (warm,) = _gen(eng, cases)
        differ += warm != base
    assert differ > 0


def test_tp2_equals_tp1_bit_for_bit_cached_chunked_and_batched(make_bf16, model_dir, img) -> None:
    """The row-parallel layers reduce in the model's fixed blocks on every TP size, so a
    tp=2 group answers one rank's bits (tokens, logprobs, every logit) cold, with the
    image's prefix cached, in chunks and among other requests."""
    chunked = {"page_size": 16, "max_prefill_tokens": 37}
    (tp1,) = _gen(make_bf16(disable_radix_cache=True, page_size=1), [_target(img)])
    with tp_engine(model_dir, 2, dtype="bfloat16", deterministic=True, **chunked) as eng:
        (cold,) = _gen(eng, [_target(img)])
        _gen(eng, _others(img)[:1])
        (warm,) = _gen(eng, [_target(img)])
        mixed = _gen(eng, [*_others(img), _target(img)])
    assert cold == tp1
    assert warm == tp1 and mixed[-1] == tp1
    # and the other requests of the batch equal theirs alone on one rank
    alone = _gen(make_bf16(**chunked), _others(img))
    assert mixed[:-1] == alone


def test_fp32_still_equals_transformers(make_engine, ref_model, photos) -> None:
    eng = make_engine(deterministic=True, page_size=16, max_prefill_tokens=100)
    img = eng.processor.prepare_image(next(iter(photos.values())))
    check_against_reference(eng, ref_model, user(None, QUESTIONS[0]), [img], "deterministic")
    # and again with the image's prefix cached: the same tokens
    check_against_reference(eng, ref_model, user(None, QUESTIONS[0]), [img], "cached")


def test_deterministic_tp_refuses_quantized_weights(model_dir) -> None:
    """Quantized row-parallel layers still all-reduce rounded partials: refused before
    any rank starts, naming the flags."""
    cfg = EngineConfig(
        model_path=str(model_dir), tp=2, deterministic=True, quantization="int8", dtype="bfloat16"
    )
    with pytest.raises(ValueError, match=r"--deterministic with --tp 2 runs unquantized"):
        Engine(cfg)
