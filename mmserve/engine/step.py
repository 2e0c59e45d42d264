"""The pieces of one engine step (:meth:`EngineCore.step`): schedule, forward, sample,
update. Sampling itself stays in :mod:`mmserve.engine.engine` (a batch at once, row by
row when that raises).

- :func:`schedule_step`: the decode requests and prefill chunks of a step.
- :func:`run_mixed`: their logits, a failed part contained to its own requests.
- :func:`logit_rows`: the scheduler records the computed K/V; the rows of the requests
  that sample a token now are picked.
- :func:`token_delta`: what the update hands out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from mmserve.config import EngineConfig
from mmserve.engine.model_runner import ModelRunner
from mmserve.engine.request import Request
from mmserve.engine.scheduler import Scheduler
from mmserve.types import TokenDelta

log = logging.getLogger(__name__)

#: ``(request, tokens to compute)`` of a step's prefill part
Chunks = list[tuple[Request, int]]


def schedule_step(sched: Scheduler, config: EngineConfig) -> tuple[list[Request], Chunks]:
    """The running requests that decode this step and the prefill chunks beside them.

    A mixed step (the default) carries every running request's next token plus prefill
    chunks in what is left of ``config.mixed_step_tokens()``; with
    ``config.disable_mixed_steps`` a step is a prefill batch when anything can be
    admitted, else a decode batch.
    """
    if config.disable_mixed_steps:
        chunks = sched.schedule_prefill()
        decode: list[Request] = []
        if not chunks and sched.running:
            sched.prepare_decode()
            decode = list(sched.running)
        return decode, chunks
    decode = []
    if sched.running:
        sched.prepare_decode()
        decode = list(sched.running)
    budget = config.max_prefill_tokens
    if decode:  # streams wait for this step: one bounded chunk's time at most
        budget = min(budget, max(1, config.mixed_step_tokens() - len(decode)))
    return decode, sched.schedule_prefill(budget)


def record_vision(runner: ModelRunner, chunks: Chunks) -> None:
    """Add the vision-tower counts and times of the step just run to its prefill
    requests (chunked prefill: first tower start, last tower end)."""
    found = runner.take_vision_counts()
    times = runner.take_vision_times()
    for req, _ in chunks:
        needing, runs = found.get(req.rid, (0, 0))
        req.images_needing_vision += needing
        req.vision_tower_runs += runs
        if req.rid in times:
            start, end = times[req.rid]
            req.vision_time = (req.vision_time[0] if req.vision_time else start, end)


def run_mixed(
    runner: ModelRunner,
    decode: list[Request],
    chunks: Chunks,
    run_batch: Callable[[list[Request], Callable[[], torch.Tensor]], torch.Tensor | None],
) -> torch.Tensor | None:
    """Logits ``[len(decode) + len(chunks), vocab]`` of one step, or None if all failed.

    ``run_batch(reqs, run)`` returns ``run()``'s logits, or None after failing ``reqs``.
    A mixed batch that raises is run again as its decode part and its prefill part
    (each one's new K/V is written again), so that a fault fails only the part that
    raises it, as it would with separate steps; a failed part's rows are NaN and its
    requests already ended with finish reason "error".
    """
    prefill_reqs = [r for r, _ in chunks]
    extends = [n for _, n in chunks]
    if not chunks:
        return run_batch(decode, lambda: runner.decode(decode))
    if not decode:
        return run_batch(prefill_reqs, lambda: runner.prefill(prefill_reqs, extends))
    reqs = decode + prefill_reqs
    try:
        return runner.prefill(reqs, [1] * len(decode) + extends)
    except Exception:  # noqa: BLE001 - retried as two batches below
        log.warning("mixed step failed; running its decode and prefill parts apart")
    parts = [
        run_batch(decode, lambda: runner.decode(decode)),
        run_batch(prefill_reqs, lambda: runner.prefill(prefill_reqs, extends)),
    ]
    if parts[0] is None and parts[1] is None:
        return None
    done = next(p for p in parts if p is not None)
    filled = [
        p
        if p is not None
        else torch.full((len(rs), done.shape[-1]), float("nan"), device=done.device)
        for p, rs in zip(parts, (decode, prefill_reqs), strict=True)
    ]
    return torch.cat(filled)


def logit_rows(
    sched: Scheduler, decode: list[Request], chunks: Chunks, logits: torch.Tensor
) -> tuple[list[Request], torch.Tensor | None]:
    """Record the step's computed K/V in the scheduler and pick the logit rows of the
    requests that sample a token now.

    Args:
        sched: the scheduler (:meth:`Scheduler.on_decoded`, :meth:`Scheduler.on_prefilled`).
        decode: the step's decode requests (rows ``[0, len(decode))`` of ``logits``).
        chunks: its prefill chunks (the rows after them, one per chunk).
        logits: ``[len(decode) + len(chunks), vocab]``.

    Returns:
        ``(batch, rows)``: the requests that sample (live decode ones, then those whose
        whole prompt is in), and their rows ``[len(batch), vocab]`` (None when empty).
        A request that ended with its failed part of the step is left out.
    """
    batch: list[Request] = []
    rows = []
    live = [r for r in decode if not r.finished]
    if live:
        sched.on_decoded(live)
        batch += live
        if len(live) == len(decode):  # the usual case: a view, no index list to convert
            rows.append(logits[: len(decode)])
        else:
            keep = [i for i, r in enumerate(decode) if not r.finished]
            rows.append(logits[torch.tensor(keep, device=logits.device)])
    for i, (req, n) in enumerate(chunks):
        if req.finished:  # its part of the batch failed
            continue
        if sched.on_prefilled(req, n):  # the whole prompt is in: sample a token
            batch.append(req)
            rows.append(logits[len(decode) + i : len(decode) + i + 1])
    if not batch:
        return batch, None
    return batch, torch.cat(rows) if len(rows) > 1 else rows[0]


def token_delta(req: Request, start: int) -> TokenDelta:
    """``req``'s output from token ``start`` on, with its progress so far, as the
    :class:`TokenDelta` its ``on_update`` gets (the last one carries the finish reason)."""
    return TokenDelta(
        rid=req.rid,
        token_ids=tuple(req.output_ids[start:]),
        logprobs=tuple(req.logprobs[start:]) if req.logprobs is not None else None,
        time=time.perf_counter(),
        cached_tokens=req.cached_len,
        images_needing_vision=req.images_needing_vision,
        vision_tower_runs=req.vision_tower_runs,
        admitted=req.admitted_at,
        vision_time=req.vision_time,
        finish_reason=req.finish_reason,
        error=req.error,
        logits=tuple(req.logits[start:]) if req.logits is not None else None,
    )
