"""Token sampling: logits processors, then greedy, temperature, top-k and top-p with
per-request seeds.

Order of operations on one step's fp32 logits ``[batch, vocab]`` (``EngineCore.step``):

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
(:class:`ProcessorState`): the distinct ids their penalties touch and an fp32 count
of each in the output, updated by one scatter of the ids added since the last step,
never recounted; each step touches only those columns, never the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from mmserve.types import SamplingParams, TokenLogprob

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


def _sample_tensor(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """:func:`sample_token` without reading the result back: int64 ``[1]`` on the
    logits' device (no host-device sync)."""
    if is_greedy(params):
        return torch.argmax(logits).reshape(1)
    return torch.multinomial(sampling_probs(logits, params), 1, generator=generator)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled (non-greedy) request draws its token from: softmax of
    ``logits / temperature`` restricted to top-k, then to top-p (renormalized by
    ``torch.multinomial``'s caller or, for speculation, by
    :mod:`mmserve.engine.spec_decode`).

    Args:
        logits: fp32 ``[vocab]`` (never-sampled ids at ``-inf``).
        params: sampling parameters with ``temperature`` above the greedy threshold.

    Returns:
        fp32 ``[vocab]`` non-negative weights (summing to 1 without top-p; to the kept
        mass with it).
    """
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
    return probs


def sample_batch(
    rows: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row, with one host-device sync for the whole batch.

    Greedy rows take one batched ``argmax``; each sampled row runs :func:`sample_token`'s
    arithmetic with its own generator (so seeded outputs are identical to sampling rows
    one at a time), and nothing is read back until every row is done.

    Args:
        rows: fp32 logits ``[B, vocab]`` (never-sampled ids at ``-inf``).
        params: each row's sampling parameters.
        generators: each row's generator (None for greedy rows).

    Returns:
        ``B`` token ids.

    Raises:
        RuntimeError: from torch for a row that cannot be sampled (e.g. all ``-inf``);
            the caller then samples row by row to fail only that request.
    """
    greedy = [i for i, p in enumerate(params) if is_greedy(p)]
    out = torch.empty(len(params), dtype=torch.int64, device=rows.device)
    if greedy:
        sel = greedy if len(greedy) < len(params) else slice(None)
        out[sel] = torch.argmax(rows[sel], dim=-1)
    for i, p in enumerate(params):
        if not is_greedy(p):
            out[i : i + 1] = _sample_tensor(rows[i], p, generators[i])
    return out.tolist()


def batch_logprobs(
    rows: torch.Tensor, tokens: Sequence[int], tops: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """:func:`token_logprob` for the rows that ask for logprobs, in one pass.

    Args:
        rows: fp32 logits ``[B, vocab]`` as sampled.
        tokens: the chosen id of each row.
        tops: each row's ``params.logprobs`` (None: no logprobs for that row).

    Returns:
        One :class:`TokenLogprob` per row, None where ``tops`` is None.
    """
    want = [i for i, t in enumerate(tops) if t is not None]
    out: list[TokenLogprob | None] = [None] * len(tops)
    if not want:
        return out
    logp = torch.log_softmax(rows[want].float(), dim=-1)
    chosen = logp.gather(1, torch.tensor([tokens[i] for i in want], device=logp.device)[:, None])
    k = min(max(tops[i] or 0 for i in want), logp.shape[1])
    values: list[list[float]] = []  # [len(want), k] (k = 0: no row asks alternatives)
    ids: list[list[int]] = []
    if k > 0:
        top_values, top_ids = torch.topk(logp, k, dim=-1)
        values, ids = top_values.tolist(), top_ids.tolist()
    chosen_logp: list[float] = chosen[:, 0].tolist()
    for j, i in enumerate(want):
        top = tops[i] or 0
        alts: list[tuple[int, float]] = []
        if top > 0:
            alts = [
                (t, v)
                for t, v in zip(ids[j][:top], values[j][:top], strict=True)
                if v != float("-inf")  # masked ids (a grammar may allow fewer than ``top``)
            ]
        out[i] = TokenLogprob(tokens[i], chosen_logp[j], alts)
    return out


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
    return int(_sample_tensor(logits, params, generator))


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


class ProcessorState:
    """One request's logits-processor state: the ids its penalties touch, with counts.

    Only ids that occur matter to the penalties, so they are applied to those columns
    alone (``O(distinct ids)`` per step, not ``O(vocab)``). The id bookkeeping is in
    Python (the output ids are Python ints already), so no step waits on the device.

    Attributes:
        ids: int64 ``[d]`` on the device: the distinct ids penalised so far, in order of
            first occurrence; the prompt's text ids first with a repetition penalty
            (image pseudo-ids are negative, no vocabulary ids, and left out), then each
            output id the first time it is sampled. None without any penalty.
        out_counts: fp32 ``[d]``: how often ``ids[i]`` occurs in the output (0 for an
            id only in the prompt).
        position: id -> its index in ``ids``.
        counted: how many leading output ids ``out_counts`` includes.
        bias_ids: int64 ``[n]`` ids of ``logit_bias`` (None without one).
        bias_values: fp32 ``[n]`` their biases.
    """

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None
        self.out_counts: torch.Tensor | None = None
        self.position: dict[int, int] = {}
        self.counted = 0
        self.bias_ids: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None

    def counts(self, vocab_size: int) -> torch.Tensor:
        """Output counts as a dense fp32 ``[vocab_size]`` (tests, debugging)."""
        dense = torch.zeros(vocab_size, dtype=torch.float32)
        if self.ids is not None:
            ids, out_counts = self.penalised()
            dense[ids.cpu()] = out_counts.cpu()
        return dense

    def penalised(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, out_counts)`` of a request with a penalty (set together, at its first
        :meth:`LogitsProcessors.state`)."""
        assert self.ids is not None and self.out_counts is not None
        return self.ids, self.out_counts

    def bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(bias_ids, bias_values)`` of a request with a ``logit_bias`` (set together)."""
        assert self.bias_ids is not None and self.bias_values is not None
        return self.bias_ids, self.bias_values


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

    Each kind is one gather and one scatter over the columns it touches, for all the
    batch's rows together; rows given as one ``[B, vocab]`` tensor change in place.

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
        """``req``'s state, made on first use, with its output counts brought up to date.

        Only the output ids added since the previous call are counted (sampled or
        jump-forward tokens alike), in one scatter.
        """
        st = req.processor_state
        if st is None:
            st = req.processor_state = self._new_state(req)
        if st.ids is not None and st.counted < len(req.output_ids):
            new = req.output_ids[st.counted :]
            st.counted = len(req.output_ids)
            self._track(st, new)
            where = torch.tensor([st.position[t] for t in new], device=self.device)
            st.penalised()[1].index_put_(
                (where,), torch.ones(len(new), device=self.device), accumulate=True
            )
        return st

    def _new_state(self, req: Request) -> ProcessorState:
        p = req.params
        st = ProcessorState()
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            st.ids = torch.zeros(0, dtype=torch.long, device=self.device)
            st.out_counts = torch.zeros(0, dtype=torch.float32, device=self.device)
            if p.repetition_penalty != 1.0:  # image pseudo-ids are negative: left out
                self._track(st, [t for t in req.input_ids if 0 <= t < self.vocab_size])
        if p.logit_bias:
            st.bias_ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=self.device)
            st.bias_values = torch.tensor(
                list(p.logit_bias.values()), dtype=torch.float32, device=self.device
            )
        return st

    def _track(self, st: ProcessorState, ids: Sequence[int]) -> None:
        """Add the ids not yet in ``st.ids`` (with count 0)."""
        fresh = []
        for t in ids:
            if t not in st.position:
                st.position[t] = len(st.position)
                fresh.append(t)
        if fresh:
            old_ids, old_counts = st.penalised()
            st.ids = torch.cat([old_ids, torch.tensor(fresh, dtype=torch.long, device=self.device)])
            st.out_counts = torch.cat([old_counts, torch.zeros(len(fresh), device=self.device)])

    def apply(self, reqs: Sequence[Request], rows: Rows) -> Rows:
        """Add ``logit_bias`` and apply the penalties to the rows of requests that ask.

        Args:
            reqs: the batch; ``reqs[i]`` samples from ``rows[i]``.
            rows: fp32 logits ``[B, vocab]`` (changed in place) or B rows ``[vocab]``.

        Returns:
            ``rows`` itself when no request asks or when it is a tensor; else a new list
            whose processed rows are new tensors.
        """
        picked = [i for i, r in enumerate(reqs) if r.processed]
        if not picked:
            return rows
        states = {i: self.state(reqs[i]) for i in picked}  # counts brought up to date
        idx = [i for i in picked if _changes_logits(reqs[i].params)]
        if not idx:  # min_tokens alone: applied after the grammar mask
            return rows
        with torch.inference_mode():  # the model's logits are inference tensors
            x, at = _as_matrix(rows, idx)
            params = [reqs[i].params for i in idx]
            sts = [states[i] for i in idx]
            ks = [k for k, st in enumerate(sts) if st.bias_ids is not None]
            if ks:
                r, cols = self._cells(at, ks, [sts[k].bias()[0] for k in ks])
                x[r, cols] = x[r, cols] + torch.cat([sts[k].bias()[1] for k in ks])
            ks = [k for k, p in enumerate(params) if p.repetition_penalty != 1.0]
            if ks:
                r, cols = self._cells(at, ks, [sts[k].penalised()[0] for k in ks])
                pen = self._per_cell([params[k].repetition_penalty for k in ks], sts, ks)
                v = x[r, cols]
                x[r, cols] = torch.where(v > 0, v / pen, v * pen)
            ks = [k for k, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
            if ks:
                r, cols = self._cells(at, ks, [sts[k].penalised()[0] for k in ks])
                f = self._per_cell([params[k].frequency_penalty for k in ks], sts, ks)
                pr = self._per_cell([params[k].presence_penalty for k in ks], sts, ks)
                c = torch.cat([sts[k].penalised()[1] for k in ks])
                x[r, cols] = x[r, cols] - (f * c + pr * (c > 0).float())
            return _from_matrix(rows, idx, x)

    def apply_min_tokens(self, reqs: Sequence[Request], rows: Rows) -> Rows:
        """End-of-sequence ids to ``-inf`` in the rows of requests short of ``min_tokens``.

        A constrained request's row where that would leave no finite logit (the grammar
        allows only end of sequence) is left as it is: the request ends there. Other
        rows always keep finite logits (only ``never_sample_ids`` are ``-inf``), so only
        constrained rows are checked (a pass over the vocabulary).

        Args:
            reqs: the batch; ``reqs[i]`` samples from ``rows[i]``.
            rows: fp32 logits ``[B, vocab]`` (changed in place) or B rows ``[vocab]``,
                after the grammar mask.

        Returns:
            As :meth:`apply`.
        """
        idx = [
            i
            for i, r in enumerate(reqs)
            if r.processed and len(r.output_ids) < r.params.min_tokens and not r.params.ignore_eos
        ]
        if not idx or not len(self.stop_ids):
            return rows
        with torch.inference_mode():
            x, at = _as_matrix(rows, idx)
            r = torch.tensor(at, device=x.device).unsqueeze(1)
            # only a grammar can leave nothing but end of sequence: check those rows alone
            g = [k for k, i in enumerate(idx) if reqs[i].grammar is not None]
            before = x[r[g], self.stop_ids] if g else None  # [len(g), stops]
            x[r, self.stop_ids] = float("-inf")
            if before is not None:  # g: the constrained rows
                rg = r[g]
                left = (x[rg.squeeze(1)] > float("-inf")).any(dim=1, keepdim=True)
                x[rg, self.stop_ids] = torch.where(left, x[rg, self.stop_ids], before)
            return _from_matrix(rows, idx, x)

    def _cells(
        self, at: list[int], ks: list[int], cols: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column indices of ``cols[j]`` in row ``at[ks[j]]``, for all ``j``."""
        lens = [len(c) for c in cols]
        rows = torch.tensor([at[k] for k in ks], device=self.device)
        counts = torch.tensor(lens, device=self.device)
        return rows.repeat_interleave(counts, output_size=sum(lens)), torch.cat(cols)

    def _per_cell(
        self, values: list[float], sts: list[ProcessorState], ks: list[int]
    ) -> torch.Tensor:
        """``values[j]`` repeated once per id of ``sts[ks[j]]`` (fp32 ``[cells]``)."""
        lens = [len(sts[k].penalised()[0]) for k in ks]
        v = torch.tensor(values, dtype=torch.float32, device=self.device)
        return v.repeat_interleave(torch.tensor(lens, device=self.device), output_size=sum(lens))


def _changes_logits(p: SamplingParams) -> bool:
    """Whether :meth:`LogitsProcessors.apply` has anything to do for ``p``."""
    return bool(
        p.logit_bias or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
    )


def _as_matrix(rows: Rows, idx: list[int]) -> tuple[torch.Tensor, list[int]]:
    """A ``[n, vocab]`` tensor holding rows ``idx`` and where each is in it: ``rows``
    itself (in place) when it is a tensor, else a stack of the selected rows."""
    if isinstance(rows, torch.Tensor):
        return rows, idx
    return torch.stack([rows[i] for i in idx]), list(range(len(idx)))


def _from_matrix(rows: Rows, idx: list[int], x: torch.Tensor) -> Rows:
    """``rows`` after :func:`_as_matrix`'s ``x`` was processed."""
    if isinstance(rows, torch.Tensor):
        return rows
    out = list(rows)
    for k, i in enumerate(idx):
        out[i] = x[k]
    return out
