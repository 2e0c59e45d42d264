"""The one output comparator of DESIGN.md invariant 4.

Tokens must match, except at a near-tie of the reference: if at the first
differing step the reference's gap between its top two logits is below
``TIE_EPS``, the two runs may legitimately pick different tokens; from there
on only that step's logits are compared, within ``LOGIT_RTOL`` of the reference's largest logit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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
