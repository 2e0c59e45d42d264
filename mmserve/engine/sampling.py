"""Token sampling: greedy, temperature, top-k and top-p with per-request seeds."""

from __future__ import annotations

import torch

from mmserve.engine.request import SamplingParams, TokenLogprob

#: Temperatures below this sample greedily (as in vLLM): dividing logits by a smaller
#: one overflows fp32 and would make the softmax NaN.
GREEDY_TEMPERATURE = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    """Whether ``params`` pick the most likely token (temperature 0 or below 1e-5)."""
    return params.temperature < GREEDY_TEMPERATURE


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A seeded generator for sampled requests; None for greedy ones."""
    if is_greedy(params):
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed % (1 << 64))  # any int; torch takes 64 bits
    return g


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> int:
    """Pick one token.

    Args:
        logits: fp32 ``[vocab]`` with never-sampled ids already at ``-inf``.
        params: the request's sampling parameters.
        generator: the request's seeded generator (unused when greedy).

    Returns:
        The chosen token id. Top-k then top-p (Holtzman et al., "The Curious
        Case of Neural Text Degeneration", arXiv 1904.09751, Section 3.1).
    """
    if is_greedy(params):
        return int(torch.argmax(logits))
    scaled = logits / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = cum - sorted_p >= params.top_p
        drop[0] = False  # a top_p below fp32's range would otherwise drop every token
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """Log-probability of ``token`` and the ``top`` most likely alternatives.

    Args:
        logits: fp32 ``[vocab]`` as given to :func:`sample_token` (masked ids at ``-inf``);
            the distribution is the unscaled softmax, whatever the temperature.
        token: the chosen token id.
        top: how many alternatives to report (0..20).

    Returns:
        A :class:`TokenLogprob` with natural-log probabilities; alternatives at ``-inf``
        (masked) are left out.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    alts: list[tuple[int, float]] = []
    if top > 0:
        values, ids = torch.topk(logp, min(top, logp.numel()))
        alts = [
            (int(i), float(v))
            for i, v in zip(ids.tolist(), values.tolist(), strict=True)
            if v != float("-inf")  # masked ids (a grammar may allow fewer than ``top``)
        ]
    return TokenLogprob(token, float(logp[token]), alts)
