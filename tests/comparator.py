"""The one output comparator of invariant (4) (docs/architecture.md, section 2).

Tokens must match, except at a near-tie of the reference: if at the first
differing step the reference's gap between its top two logits is below
``TIE_EPS``, the two runs may legitimately pick different tokens; from there
on only that step's logits are compared, within ``LOGIT_RTOL`` of the reference's largest logit.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from mmserve.cache.kv_pool import KVPool
from mmserve.kernels.metadata import build_metadata

TIE_EPS = 1e-3
LOGIT_RTOL = 1e-3  # of the reference's largest |logit|; fp32 kernels differ by ~1e-5


def _logits_close(ours: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    ours, ref = ours.float(), ref.float()
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(ours)):
        return False, float("inf")
    diff = (ours[finite] - ref[finite]).abs().max().item()
    return diff <= LOGIT_RTOL * max(1.0, ref[finite].abs().max().item()), diff


def assert_same_generation(
    ours_ids: Sequence[int],
    ref_ids: Sequence[int],
    ours_logits: Sequence[torch.Tensor] | None = None,
    ref_logits: Sequence[torch.Tensor] | None = None,
    what: str = "",
) -> None:
    """Assert two greedy generations agree under the near-tie rule.

    Args:
        ours_ids, ref_ids: generated token ids.
        ours_logits, ref_logits: per-step fp32 logits ``[vocab]`` (needed to accept
            a divergence; without them any divergence fails).
        what: label for the failure message.
    """
    for step, (a, b) in enumerate(zip(ours_ids, ref_ids, strict=False)):
        if a == b:
            if ours_logits is not None and ref_logits is not None:
                ok, diff = _logits_close(ours_logits[step], ref_logits[step])
                assert ok, f"{what}: step {step} logits differ by {diff}"
            continue
        assert ours_logits is not None and ref_logits is not None, (
            f"{what}: token {step} differs ({a} vs {b}) and no logits to check a near-tie; "
            f"ours={list(ours_ids)} ref={list(ref_ids)}"
        )
        top2 = torch.topk(ref_logits[step].float(), 2).values
        gap = (top2[0] - top2[1]).item()
        assert gap < TIE_EPS, (
            f"{what}: token {step} differs ({a} vs {b}) but the reference's top-2 gap is "
            f"{gap:.4g} >= {TIE_EPS}; ours={list(ours_ids)} ref={list(ref_ids)}"
        )
        ok, diff = _logits_close(ours_logits[step], ref_logits[step])
        assert ok, f"{what}: near-tie at step {step}, logits differ by {diff}"
        return
    assert len(ours_ids) == len(ref_ids), (
        f"{what}: lengths differ {len(ours_ids)} vs {len(ref_ids)}: {list(ours_ids)} / "
        f"{list(ref_ids)}"
    )


def reference_generate(ref_model, text: str, images: list, never: list[int], max_new: int):  # noqa: ANN001, ANN201
    """transformers' greedy ``generate`` on ``(model, processor)``: ``(ids, logits, prompt_len)``.

    The logits are fp32 ``[vocab]`` per step with ``never`` ids at -inf, as our sampler
    masks them.
    """
    model, processor = ref_model
    inputs = processor(images=images or None, text=text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new,
            do_sample=False,
            suppress_tokens=never,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ids = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logits = [step[0].float() for step in out.logits]
    # generate's logits are pre-processor; apply the same mask our sampler uses
    for lg in logits:
        lg[never] = float("-inf")
    return ids, logits, inputs["input_ids"].shape[1]


# Largest |logit difference| accepted between a bf16 and a reference run, as a
# fraction of the reference's largest |logit|. bf16 vs fp32 on the tiny model
# measures up to ~0.021 (tests below); two bf16 kernels should be closer.
BF16_LOGIT_RTOL = 4e-2


def random_batch(page_size: int, mode: str, hq: int, hkv: int, dtype, device="cpu", seed=0):  # noqa: ANN001, ANN201
    """A pool filled with random K/V plus a batch of 4 requests over shuffled pages.

    ``mode``: "prefill" (no cached prefix), "partial" (a cached prefix that ends
    mid-page when ``page_size > 1``) or "decode" (one new token after a prefix).
    Returns ``(pool, meta, q, k, v)``; q/k/v are the new tokens' ``[T, H, 64]``.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    d, layers = 64, 2
    seqs = [rng.randint(2, 40) for _ in range(4)]
    if mode == "prefill":
        prefix = [0] * 4
    elif mode == "decode":
        prefix = [s - 1 for s in seqs]
    else:
        prefix = [rng.randint(1, s - 1) for s in seqs]
    n_pages = sum(-(-s // page_size) for s in seqs) + 3
    pool = KVPool(n_pages, page_size, layers, hkv, d, dtype=dtype, device=device)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    ids = list(range(n_pages))
    rng.shuffle(ids)
    tables, at = [], 0
    for s in seqs:
        n = -(-s // page_size)
        tables.append(ids[at : at + n])
        at += n
    extend = [s - p for s, p in zip(seqs, prefix, strict=True)]
    meta = build_metadata(tables, prefix, extend, page_size, device)
    t = sum(extend)

    def rnd(h: int) -> torch.Tensor:
        return torch.randn(t, h, d, generator=gen).to(dtype).to(device)

    return pool, meta, rnd(hq), rnd(hkv), rnd(hkv)
