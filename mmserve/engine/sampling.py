"""Token sampling: logits processors, then greedy, temperature, top-k and top-p with
per-request seeds.

Order of operations on one step's fp32 logits ``[batch, vocab]`` (``Engine.step``):

1. the model runner's mask (image placeholder, padding at ``-inf``);
2. :meth:`LogitsProcessors.apply`: ``logit_bias`` added, then ``repetition_penalty``,
   then ``frequency_penalty`` and ``presence_penalty`` (vLLM's sampler applies them in
   this order; the penalties therefore see biased logits);
3. the structured-output grammar mask (:meth:`GuidedDecoding.apply_masks`): bias and
   penalties come before it, so they only reorder what the grammar allows and can
   never bring back a token it forbids;
4. :meth:`LogitsProcessors.apply_min_tokens`: end-of-sequence ids at ``-inf`` while
   fewer than ``min_tokens`` tokens are out; it comes after the grammar mask so that it
   can yield to it: where the grammar allows nothing but end of sequence, the request
   ends (structure wins over length), instead of a row with no token left;
5. :func:`sample_token` (temperature, top-k, top-p) on that row, and
   :func:`token_logprob` for logprobs, from the same row.

Requests without any of these parameters (``Request.processed`` false) are never
touched: no copy, no state. The others keep their state incrementally
(:class:`ProcessorState`): an fp32 count of each output id, updated by one scatter of
the ids added since the last step, never recounted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mmserve.engine.request import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from mmserve.engine.request import Request

#: One step's logits as the engine hands them around: ``[B, vocab]`` or B rows.
Rows = torch.Tensor | Sequence[torch.Tensor]

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
            the distribution is the unscaled softmax, whatever the temperature. The
            engine passes the row after the logits processors and the grammar mask, so
            ``logit_bias``, the penalties and ``min_tokens`` are included (unlike vLLM's
            default raw logprobs), temperature, top-k and top-p are not.
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


@dataclass
class ProcessorState:
    """One request's logits-processor state, on the engine's device.

    Attributes:
        counts: fp32 ``[vocab]``, how often each id occurs in the output so far; None
            without a presence, frequency or repetition penalty.
        counted: how many leading output ids ``counts`` includes.
        prompt_seen: bool ``[vocab]``, ids that occur in the prompt (image pseudo-ids,
            which are negative and no vocabulary ids, left out); None without a
            repetition penalty.
        bias_ids: int64 ``[n]`` ids of ``logit_bias`` (None without one).
        bias_values: fp32 ``[n]`` their biases.
    """

    counts: torch.Tensor | None = None
    counted: int = 0
    prompt_seen: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None


class LogitsProcessors:
    """``logit_bias``, presence, frequency and repetition penalties and ``min_tokens``,
    applied to a whole batch of logits rows at once (see the module docstring for where).

    Definitions (each on the logits ``l`` of one request, ``c[j]`` the count of id ``j``
    in its output so far):

    - ``logit_bias``: ``l[j] += bias[j]`` (OpenAI's ``logit_bias``);
    - ``repetition_penalty`` ``r``: for every ``j`` in the prompt or the output,
      ``l[j] /= r`` if ``l[j] > 0`` else ``l[j] *= r`` (CTRL, Keskar et al., arXiv
      1909.05858, Section 4.1, in transformers' and vLLM's form);
    - ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p``:
      ``l[j] -= f * c[j] + p * (c[j] > 0)`` (OpenAI's definition; output ids only);
    - ``min_tokens`` ``m``: while ``len(output) < m``, ``l[eos] = -inf`` for every
      end-of-sequence id (unless ``ignore_eos``, where they end nothing).

    Args:
        vocab_size: logits columns (the decoder's vocabulary, padding included).
        stop_ids: end-of-sequence ids that ``min_tokens`` holds back.
        device: where the logits live; per-request state is kept there.
    """

    def __init__(
        self, vocab_size: int, stop_ids: Sequence[int], device: torch.device | str
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=self.device)

    def state(self, req: Request) -> ProcessorState:
        """``req``'s state, made on first use, with ``counts`` brought up to date.

        Only the output ids added since the previous call are counted (sampled or
        jump-forward tokens alike), in one scatter.
        """
        st = req.processor_state
        if st is None:
            st = req.processor_state = self._new_state(req)
        if st.counts is not None and st.counted < len(req.output_ids):
            new = torch.tensor(req.output_ids[st.counted :], dtype=torch.long, device=self.device)
            st.counts.index_put_((new,), torch.ones_like(new, dtype=torch.float32), accumulate=True)
            st.counted = len(req.output_ids)
        return st

    def _new_state(self, req: Request) -> ProcessorState:
        p = req.params
        st = ProcessorState()
        V, dev = self.vocab_size, self.device
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            st.counts = torch.zeros(V, dtype=torch.float32, device=dev)
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(req.input_ids, dtype=torch.long)
            ids = ids[(ids >= 0) & (ids < V)]  # image pseudo-ids are negative
            st.prompt_seen = torch.zeros(V, dtype=torch.bool, device=dev)
            st.prompt_seen[ids.to(dev)] = True
        if p.logit_bias:
            st.bias_ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
            st.bias_values = torch.tensor(
                list(p.logit_bias.values()), dtype=torch.float32, device=dev
            )
        return st

    def apply(self, reqs: Sequence[Request], rows: Rows) -> Rows:
        """Add ``logit_bias`` and apply the penalties to the rows of requests that ask.

        Args:
            reqs: the batch; ``reqs[i]`` samples from ``rows[i]``.
            rows: fp32 logits ``[B, vocab]`` or B rows ``[vocab]``.

        Returns:
            ``rows`` itself when no request asks; else the processed rows (a new
            ``[B, vocab]`` tensor, or a new list where processed rows are new tensors).
        """
        picked = [i for i, r in enumerate(reqs) if r.processed]
        if not picked:
            return rows
        states = {i: self.state(reqs[i]) for i in picked}  # counts brought up to date
        idx = [i for i in picked if _changes_logits(reqs[i].params)]
        if not idx:  # min_tokens alone: applied after the grammar mask
            return rows
        x = _gather(rows, idx)
        sts = [states[i] for i in idx]
        params = [reqs[i].params for i in idx]

        biased = [k for k, st in enumerate(sts) if st.bias_ids is not None]
        if biased:
            ids = [sts[k].bias_ids for k in biased]
            where = self._index(biased).repeat_interleave(
                torch.tensor([len(t) for t in ids], device=self.device)
            )
            cols = torch.cat(ids)
            x[where, cols] = x[where, cols] + torch.cat([sts[k].bias_values for k in biased])

        rep = [k for k, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep:
            rk = self._index(rep)
            seen = torch.stack([sts[k].prompt_seen | (sts[k].counts > 0) for k in rep])
            r = self._column([params[k].repetition_penalty for k in rep])
            factor = torch.where(seen, r, torch.ones_like(r))
            sub = x[rk]
            x[rk] = torch.where(sub > 0, sub / factor, sub * factor)

        pen = [k for k, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
        if pen:
            pk = self._index(pen)
            counts = torch.stack([sts[k].counts for k in pen])
            f = self._column([params[k].frequency_penalty for k in pen])
            pr = self._column([params[k].presence_penalty for k in pen])
            x[pk] = x[pk] - (f * counts + pr * (counts > 0).float())
        return _scatter(rows, idx, x)

    def apply_min_tokens(self, reqs: Sequence[Request], rows: Rows) -> Rows:
        """End-of-sequence ids to ``-inf`` in the rows of requests short of ``min_tokens``.

        A row where that would leave no finite logit (the grammar allows only end of
        sequence) is left as it is: the request ends there.

        Args:
            reqs: the batch; ``reqs[i]`` samples from ``rows[i]``.
            rows: fp32 logits ``[B, vocab]`` or B rows ``[vocab]``,
                after the grammar mask.

        Returns:
            ``rows`` itself when no request is short of its ``min_tokens``; else the
            masked rows (as :meth:`apply`).
        """
        idx = [
            i
            for i, r in enumerate(reqs)
            if r.processed and len(r.output_ids) < r.params.min_tokens and not r.params.ignore_eos
        ]
        if not idx or not len(self.stop_ids):
            return rows
        x = _gather(rows, idx)
        masked = x.index_fill(1, self.stop_ids, float("-inf"))
        left = (masked > float("-inf")).any(dim=1, keepdim=True)
        return _scatter(rows, idx, torch.where(left, masked, x))

    def _index(self, ks: list[int]) -> torch.Tensor:
        return torch.tensor(ks, dtype=torch.long, device=self.device)

    def _column(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device).unsqueeze(1)


def _changes_logits(p: SamplingParams) -> bool:
    """Whether :meth:`LogitsProcessors.apply` has anything to do for ``p``."""
    return bool(
        p.logit_bias or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
    )


def _gather(rows: Rows, idx: list[int]) -> torch.Tensor:
    """A copy of ``rows[idx]`` as one ``[len(idx), vocab]`` tensor."""
    if isinstance(rows, torch.Tensor):
        return rows[torch.tensor(idx, dtype=torch.long, device=rows.device)]
    return torch.stack([rows[i] for i in idx])


def _scatter(rows: Rows, idx: list[int], x: torch.Tensor) -> Rows:
    """``rows`` with ``rows[idx[k]]`` replaced by ``x[k]`` (a new tensor: the model's
    logits are inference tensors, which cannot change in place)."""
    if isinstance(rows, torch.Tensor):
        return rows.index_copy(0, torch.tensor(idx, dtype=torch.long, device=rows.device), x)
    out = list(rows)
    for k, i in enumerate(idx):
        out[i] = x[k]
    return out
