"""N-gram speculative decoding (``--speculative ngram``): draft, verify in one forward,
accept.

Each decode step, every eligible running request gets a draft of at most
``num_speculative_tokens`` tokens from its own prompt and output
(:mod:`mmserve.engine.ngram`). One forward computes each drafted request's last token
plus its draft (a verify: the paged-KV extend path, so it runs eagerly, never through
the CUDA-graph buckets), the other decode requests' next token and the step's prefill
chunks, and gives logits at every drafted position.

Acceptance (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318), with a draft that is a
point mass on the drafted token ``d`` at each position:

- greedy: ``d`` is kept while it is the target's argmax; the first position where it is
  not gives the argmax instead, so the output is token for token the one without
  speculation;
- sampled: ``d`` is kept with probability ``p(d)`` (``p``: the request's temperature,
  top-k, top-p distribution at that position); on rejection the token is drawn from the
  residual ``max(p - onehot(d), 0)`` renormalized, i.e. ``p`` without ``d``; when every
  draft is kept, one more token is drawn from the next position's ``p``. Each emitted
  token thus follows ``p`` exactly; the request's seeded generator draws every uniform
  and token, so a seed reproduces its output.

K/V: the verify writes K/V for every drafted position, but the request's
``computed_len`` advances only over the kept ones; pages grown for the draft past what
the request keeps go back to the pool at once, so the pages it holds, the radix tree
(which takes only full pages below ``computed_len``) and the KV tiers (fed by the tree)
never hold a rejected token.

Not speculated (decoded one token a step as before): structured-output requests (each
drafted position would need the grammar state after the previous ones), requests with
logit_bias, penalties or min_tokens (their logits depend on the tokens before), steps
whose decode batch has more than ``speculative_max_batch`` requests, and a request once
its accepted tokens per verify stay below ``speculative_min_accepted`` after
``speculative_window`` verifies.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mmserve.config import EngineConfig
from mmserve.engine.ngram import NgramIndex, usable_prefix
from mmserve.engine.request import Request
from mmserve.engine.sampling import batch_logprobs, is_greedy, sampling_probs
from mmserve.engine.scheduler.spec_pages import grow_for_draft, trim_after_verify
from mmserve.engine.step import Chunks, logit_rows, record_vision
from mmserve.types import TokenLogprob

if TYPE_CHECKING:
    from mmserve.engine.engine import EngineCore
    from mmserve.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class SpecState:
    """One request's speculation state (``Request.spec``).

    Attributes:
        index: its prompt-lookup index.
        seq: its prompt then output ids, as far as :attr:`index` has seen them.
        verifies: decode steps that verified a draft of it.
        drafted: tokens drafted for it; accepted: those kept.
        off: speculation turned off for it (accepted tokens per verify too low).
    """

    index: NgramIndex
    seq: list[int] = field(default_factory=list)
    verifies: int = 0
    drafted: int = 0
    accepted: int = 0
    off: bool = False


@dataclass
class _Plan:
    """A drafted request in this step: its draft, and its page count and reservation
    before the draft's pages were grown (restored by :meth:`NgramSpeculator._trim`)."""

    draft: list[int]
    pages: int
    reserved: int
    computed: int = 0


def accept_greedy(rows: torch.Tensor, draft: list[int]) -> list[int]:
    """The tokens a greedy request emits after a verify.

    Args:
        rows: fp32 logits ``[len(draft) + 1, vocab]``: row ``j`` predicts the token after
            the request's last token and ``draft[:j]``.
        draft: the drafted ids.

    Returns:
        ``draft[:a]`` (the longest prefix equal to the rows' argmaxes) plus the argmax at
        ``a``: ``a + 1`` tokens, the output decoding one token at a time gives.
    """
    targets = torch.argmax(rows, dim=-1).tolist()
    a = 0
    while a < len(draft) and targets[a] == draft[a]:
        a += 1
    return draft[:a] + [targets[a]]


def accept_sampled(
    rows: torch.Tensor,
    draft: list[int],
    probs_of,
    generator: torch.Generator | None,
) -> list[int]:
    """The tokens a sampled request emits after a verify: rejection sampling with a
    point-mass draft (the module docstring; Leviathan et al. 2023, Algorithm 1).

    Args:
        rows: fp32 logits ``[len(draft) + 1, vocab]`` (as :func:`accept_greedy`).
        draft: the drafted ids.
        probs_of: ``[vocab]`` logits -> the request's sampling weights ``[vocab]``
            (:func:`~mmserve.engine.sampling.sampling_probs`; renormalized here).
        generator: the request's generator (every uniform and token is drawn from it).

    Returns:
        ``a + 1`` tokens: the ``a`` kept drafts, then the residual's (or, with every
        draft kept, the next position's) draw.
    """
    k = len(draft)
    probs = torch.stack([probs_of(rows[j]) for j in range(k + 1)])
    probs = probs / probs.sum(dim=-1, keepdim=True)
    dev = rows.device
    u = torch.rand(k, generator=generator, device=dev)
    p_draft = probs[torch.arange(k, device=dev), torch.tensor(draft, device=dev)]
    kept = (u < p_draft).tolist()
    a = kept.index(False) if False in kept else k
    if a == k:
        last = torch.multinomial(probs[k], 1, generator=generator)
        return draft + [int(last)]
    residual = probs[a].clone()
    residual[draft[a]] = 0.0
    if float(residual.sum()) <= 0.0:  # p(d) was 1 up to rounding: nothing else to draw
        return draft[: a + 1]
    return draft[:a] + [int(torch.multinomial(residual, 1, generator=generator))]


class NgramSpeculator:
    """Prompt-lookup drafts verified in the engine's step (see the module docstring).

    Args:
        config: ``num_speculative_tokens``, ``ngram_min``/``ngram_max``,
            ``speculative_max_batch``, ``speculative_min_accepted``, ``speculative_window``.
        vocab_size: the decoder's vocabulary (drafts stop at an id outside it).
    """

    def __init__(self, config: EngineConfig, vocab_size: int) -> None:
        self.k = config.num_speculative_tokens
        self.n_min, self.n_max = config.ngram_min, config.ngram_max
        self.max_batch = config.speculative_max_batch
        self.min_accepted = config.speculative_min_accepted
        self.window = config.speculative_window
        self.vocab_size = vocab_size

    def _ok(self, tok: int) -> bool:
        return 0 <= tok < self.vocab_size

    def draft(self, req: Request) -> list[int]:
        """``req``'s draft for this step (``[]``: it decodes one token): at most
        ``num_speculative_tokens`` and never past ``max_tokens`` (the verify's extra token
        counts too)."""
        if req.grammar is not None or req.processed:
            return []
        st = req.spec
        if st is None:
            st = req.spec = SpecState(NgramIndex(self.n_min, self.n_max), list(req.input_ids))
        if st.off:
            return []
        k = min(self.k, req.params.max_tokens - len(req.output_ids) - 1)
        if k <= 0:
            return []
        st.seq.extend(req.output_ids[len(st.seq) - req.prompt_len :])
        return usable_prefix(st.index.propose(st.seq, k), self._ok)

    def step(self, core: EngineCore, decode: list[Request], chunks: Chunks) -> list[Request] | None:
        """Run ``core``'s step with drafts verified, or None when no request has a draft
        (or the verify forward raised: nothing was kept, the ordinary step runs).

        Args:
            core: the engine (its scheduler, runner, stats, sampling and bookkeeping).
            decode: the step's decode requests (pages for their next token given).
            chunks: its prefill chunks.

        Returns:
            As :meth:`EngineCore.step`: the requests that got tokens.
        """
        stats = core.stats
        if not decode:
            return None
        if len(decode) > self.max_batch:
            stats.spec_batch_off_steps += 1
            return None
        sched = core.scheduler
        plans: dict[int, _Plan] = {}
        for i, req in enumerate(decode):
            d = self.draft(req)
            if d:
                plan = _Plan(d, len(req.pages), req.reserved_pages, req.computed_len)
                plan.draft = d[: self._grow(sched, req, len(d))]
                if plan.draft:
                    plans[i] = plan
                else:
                    self._trim(sched, req, plan)
        if not plans:
            return None
        drafts = [plans[i].draft if i in plans else [] for i in range(len(decode))]
        drafts += [[] for _ in chunks]
        reqs = decode + [r for r, _ in chunks]
        failed_before = stats.failed_steps
        try:
            logits = core.runner.prefill(reqs, [1] * len(decode) + [n for _, n in chunks], drafts)
        except Exception:
            log.warning("verify step failed; running it without drafts", exc_info=True)
            for i, plan in plans.items():
                self._trim(sched, decode[i], plan)
            return None
        record_vision(core.runner, chunks)
        stats.count_step(decode, chunks, failed_before)
        stats.spec_steps += 1
        firsts = [0]
        for d in drafts[:-1]:
            firsts.append(firsts[-1] + 1 + len(d))
        batch, rows = logit_rows(sched, decode, chunks, logits[firsts])
        drafted = {id(decode[i]) for i in plans}
        plain = [j for j, r in enumerate(batch) if id(r) not in drafted]
        if plain:
            assert rows is not None  # a non-empty batch has rows
            picked = [batch[j] for j in plain]
            core._sample_and_update(picked, core._processed(picked, rows[plain]))
        now = time.perf_counter()
        for i, plan in plans.items():
            req = decode[i]
            if not req.finished:
                k = len(plan.draft)
                try:
                    self._accept(core, req, logits[firsts[i] : firsts[i] + k + 1], plan, now)
                except Exception:  # noqa: BLE001 - fails this request only
                    core._fail([req], "while verifying its drafted tokens")
            self._trim(sched, req, plan)
        return batch

    def _accept(
        self, core: EngineCore, req: Request, rows: torch.Tensor, plan: _Plan, now: float
    ) -> None:
        """Emit ``req``'s kept drafts and its next token from its verify ``rows``
        (``[len(draft) + 1, vocab]``), advancing ``computed_len`` over the kept ones."""
        p, draft = req.params, plan.draft
        if is_greedy(p):
            out = accept_greedy(rows, draft)
        else:
            out = accept_sampled(rows, draft, lambda r: sampling_probs(r, p), req.generator)
        kept = len(out) - 1
        st = req.spec
        assert st is not None  # made by draft()
        st.verifies += 1
        st.drafted += len(draft)
        st.accepted += kept
        stats = core.stats
        stats.spec_verifies += 1
        stats.spec_drafted_tokens += len(draft)
        stats.spec_accepted_tokens += kept
        if st.verifies >= self.window and st.accepted < self.min_accepted * st.verifies:
            st.off = True
            stats.spec_requests_off += 1
        lps: list[TokenLogprob | None] = [None] * len(out)
        if p.logprobs is not None:
            lps = batch_logprobs(rows[: len(out)], out, [p.logprobs] * len(out))
        for j, tok in enumerate(out):
            # K/V of the last token and the j drafts before this one are kept
            req.computed_len = plan.computed + 1 + j
            core._append_token(req, rows[j], tok, lps[j], now, emit=j == len(out) - 1)
            if req.finished:
                break

    @staticmethod
    def _grow(sched: Scheduler, req: Request, k: int) -> int:
        """Pages for ``req``'s last token and ``k`` drafts; returns the drafts that fit."""
        return grow_for_draft(sched.kv, req, k, sched.reserved_pages)

    @staticmethod
    def _trim(sched: Scheduler, req: Request, plan: _Plan) -> None:
        """Free the draft's pages past ``req``'s sequence, restore its reservation."""
        trim_after_verify(sched.kv, req, plan.pages, plan.reserved)


def make_speculator(config: EngineConfig, vocab_size: int) -> NgramSpeculator | None:
    """The speculator ``config.speculative`` asks for, or None ("off")."""
    if config.speculative == "ngram":
        return NgramSpeculator(config, vocab_size)
    return None
