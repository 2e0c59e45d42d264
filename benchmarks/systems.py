"""Run one workload on one system and measure it.

Systems (all in one process, same prompts, greedy, ``max_tokens`` output tokens each):

- ``transformers``: ``LlavaForConditionalGeneration.generate`` one request at a time
  (``max_new_tokens = min_new_tokens = N``, ``do_sample=False``), what a user writes
  without a serving engine. TTFT is measured with a streamer (the time its ``put``
  receives the first generated token). Optionally only a subsample of requests is
  run and the wall time is extrapolated (mean seconds per request x requests).
- ``mmserve-off``: the engine with ``disable_radix_cache=True`` and
  ``vision_cache_bytes=0`` (no KV and no image features reused across requests; a
  prefill step still encodes each of its distinct images once).
- ``mmserve-<policy>``: the engine with the radix cache on and that scheduling policy.

Times are seconds from ``time.perf_counter``. TTFT is counted from the moment a request
is submitted, so it includes queueing (for the one-at-a-time baseline, the time spent
on the requests before it in the round). mmserve runs a workload with sessions
(multi_turn) closed-loop: turn 0 of every session is submitted at once, then a step
loop submits a session's next turn as soon as its previous one finishes (at most one
outstanding turn per session); other workloads, and multi_turn with
``closed_loop=False``, are submitted round by round through ``Engine.generate``.
Image decoding and content hashing (the upload) happen before timing for every system,
and so does building mmserve's requests (chat template, tokenising); per-request image
preprocessing (resize, normalise) and the vision tower are inside the timed region.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from benchmarks.workloads import Prompt, Workload
from mmserve.config import EngineConfig
from mmserve.engine.engine import Engine
from mmserve.engine.messages import EngineRequest
from mmserve.engine.request import GenerateResult, ImageInput, SamplingParams
from mmserve.model.loader import LoadedModel


@dataclass
class SystemRun:
    """Measurements of one system on one workload.

    Attributes:
        system: label (``transformers``, ``mmserve-off``, ``mmserve-lpm``, ...).
        kind: ``"transformers"`` or ``"mmserve"``.
        policy: scheduling policy (mmserve with cache on), else None.
        radix_cache: whether the prefix cache was on.
        pool_tokens: KV pool size (tokens), mmserve only.
        requests: requests in the workload.
        measured_requests: requests actually run (fewer when the baseline is subsampled).
        wall_s: wall time for all requests (seconds; extrapolated if subsampled).
        cpu_s: CPU time of this process over the same span (seconds, all threads;
            extrapolated if subsampled). With one torch thread on an otherwise idle
            machine it equals ``wall_s``; unlike wall time it is not inflated by
            other processes competing for the cores.
        output_tokens: output tokens of all requests.
        prompt_tokens: prompt tokens of the measured requests.
        cached_tokens: prompt tokens served from the prefix cache.
        ttfts_s: TTFT of each measured request from its submission (seconds).
        service_ttfts_s: TTFT without queueing, baseline only (seconds).
        vision_tower_runs: images encoded by the vision tower (all requests).
        tree_seconds: time inside radix-tree operations (seconds).
        outputs: output token ids by request index (measured requests only).
        all_finished: every request finished with ``finish_reason == "length"``.
        leak_free: pool accounting held and, after evicting the whole tree, every page
            was free (None when not checked).
        retractions: requests retracted by the scheduler (if the engine reports it).
        repeats: timed runs; the fastest one is reported.
        notes: remarks for the report.
    """

    system: str
    kind: str
    policy: str | None
    radix_cache: bool
    pool_tokens: int | None
    requests: int
    measured_requests: int
    wall_s: float
    cpu_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    ttfts_s: list[float]
    vision_tower_runs: int
    tree_seconds: float = 0.0
    service_ttfts_s: list[float] = field(default_factory=list)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    all_finished: bool = True
    leak_free: bool | None = None
    retractions: int = 0
    repeats: int = 1
    notes: list[str] = field(default_factory=list)

    @property
    def requests_per_s(self) -> float:
        """Requests per second of wall time."""
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        """Output tokens per second of wall time."""
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def requests_per_cpu_s(self) -> float:
        """Requests per second of process CPU time."""
        return self.requests / self.cpu_s if self.cpu_s > 0 else 0.0

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens (0..1)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tree_fraction(self) -> float:
        """Fraction of wall time spent in radix-tree operations (0..1)."""
        return self.tree_seconds / self.wall_s if self.wall_s > 0 else 0.0

    def ttft_percentile(self, q: float) -> float:
        """TTFT percentile ``q`` (0..100) over measured requests (seconds)."""
        return float(np.percentile(self.ttfts_s, q)) if self.ttfts_s else float("nan")

    def summary(self) -> dict[str, Any]:
        """JSON-ready metrics (outputs and per-request lists left out)."""
        return {
            "system": self.system,
            "kind": self.kind,
            "policy": self.policy,
            "radix_cache": self.radix_cache,
            "pool_tokens": self.pool_tokens,
            "requests": self.requests,
            "measured_requests": self.measured_requests,
            "wall_s": self.wall_s,
            "requests_per_s": self.requests_per_s,
            "cpu_s": self.cpu_s,
            "requests_per_cpu_s": self.requests_per_cpu_s,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": self.output_tokens_per_s,
            "ttft_p50_s": self.ttft_percentile(50),
            "ttft_p99_s": self.ttft_percentile(99),
            "service_ttft_p50_s": (
                float(np.percentile(self.service_ttfts_s, 50)) if self.service_ttfts_s else None
            ),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cache_hit_rate": self.hit_rate,
            "vision_tower_runs": self.vision_tower_runs,
            "tree_seconds": self.tree_seconds,
            "tree_fraction": self.tree_fraction,
            "all_finished": self.all_finished,
            "leak_free": self.leak_free,
            "retractions": self.retractions,
            "repeats": self.repeats,
            "notes": self.notes,
        }


def policy_supported(policy: str) -> str | None:
    """None if ``EngineConfig(policy=policy)`` validates, else the error message."""
    try:
        EngineConfig(policy=policy).validate()
    except ValueError as e:
        return str(e)
    return None


class MMServeRunner:
    """Runs workloads on fresh engines that share one loaded model.

    Args:
        model: the loaded checkpoint (weights shared by every engine).
        model_path: its directory.
        engine_kwargs: extra ``EngineConfig`` fields for every engine.
    """

    def __init__(self, model: LoadedModel, model_path: str, **engine_kwargs: Any) -> None:
        self.model = model
        self.model_path = model_path
        self.engine_kwargs = engine_kwargs
        self._images: dict[tuple[str, bytes], ImageInput] = {}

    def engine(self, **kw: Any) -> Engine:
        """A fresh engine (empty pool, tree and embedding cache)."""
        cfg = EngineConfig(model_path=self.model_path, **{**self.engine_kwargs, **kw})
        return Engine(cfg, model=self.model)

    def images(self, eng: Engine, wl: Workload) -> dict[str, ImageInput]:
        """Decoded, hashed images of ``wl`` (done once; not timed)."""
        out = {}
        for name, data in wl.images.items():
            key = (name, data)
            if key not in self._images:
                self._images[key] = eng.processor.prepare_image(data)
            out[name] = self._images[key]
        return out

    def prompt_ids(self, wl: Workload) -> list[list[int]]:
        """Prompt token ids (image pseudo-tokens included) of every request."""
        eng = self.engine(disable_radix_cache=True)
        imgs = self.images(eng, wl)
        params = SamplingParams(max_tokens=1)
        return [
            eng.processor.make_request(
                messages=p.messages, images=[imgs[n] for n in p.images], params=params
            ).input_ids
            for p in wl.prompts
        ]

    def run(
        self,
        wl: Workload,
        label: str,
        *,
        radix_cache: bool,
        policy: str = "lpm",
        max_total_tokens: int | None = None,
        check_leaks: bool = True,
        closed_loop: bool | None = None,
    ) -> SystemRun:
        """Run ``wl`` on a fresh engine and measure it.

        Args:
            closed_loop: drive ``wl.sessions`` closed-loop (each session's next turn is
                submitted when its previous one finishes); None: whenever ``wl`` has
                sessions. False: lock-step rounds through ``Engine.generate``.
        """
        if closed_loop is None:
            closed_loop = bool(wl.sessions)
        if closed_loop and not wl.sessions:
            raise ValueError(f"workload {wl.name!r} has no sessions to drive closed-loop")
        kw: dict[str, Any] = {"disable_radix_cache": not radix_cache, "policy": policy}
        if not radix_cache:
            kw["vision_cache_bytes"] = 0  # "cache off" reuses nothing, image features included
        if max_total_tokens is not None:
            kw["max_total_tokens"] = max_total_tokens
        eng = self.engine(**kw)
        imgs = self.images(eng, wl)
        params = SamplingParams(max_tokens=wl.max_tokens, temperature=0.0, ignore_eos=True)
        # built before timing (tokenising is not what is measured); arrival set on submission
        reqs = [
            eng.processor.make_request(
                messages=p.messages, images=[imgs[n] for n in p.images], params=params
            )
            for p in wl.prompts
        ]
        if closed_loop:
            results, wall, cpu = _closed_loop(eng, reqs, wl.sessions)
        else:
            results, wall, cpu = _lock_step(eng, reqs, [len(r) for r in wl.rounds])
        outputs: dict[int, list[int]] = {}
        ttfts: list[float] = []
        prompt_tokens = cached = out_tokens = 0
        finished = len(results) == len(reqs)
        for idx in sorted(results):
            res = results[idx]
            outputs[idx] = list(res.output_ids)
            ttfts.append(res.ttft)
            prompt_tokens += res.prompt_tokens
            cached += res.cached_tokens
            out_tokens += res.completion_tokens
            finished &= res.finish_reason == "length"
        stats = eng.cache_stats()
        run = SystemRun(
            system=label,
            kind="mmserve",
            policy=policy if radix_cache else None,
            radix_cache=radix_cache,
            pool_tokens=eng.pool.size_tokens,
            requests=wl.num_requests,
            measured_requests=wl.num_requests,
            wall_s=wall,
            cpu_s=cpu,
            output_tokens=out_tokens,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
            ttfts_s=ttfts,
            vision_tower_runs=int(stats["vision_tower_images"]),
            tree_seconds=float(stats.get("tree_seconds", 0.0)),
            outputs=outputs,
            all_finished=finished,
            retractions=int(stats.get("retractions", 0)),
        )
        if closed_loop:
            run.notes.append(
                f"closed loop: {len(wl.sessions)} sessions start at once; each sends its next "
                "turn when its previous answer arrives; TTFT from each turn's submission"
            )
        if check_leaks:
            run.leak_free, note = leak_check(eng)
            if note:
                run.notes.append(note)
        return run


def _lock_step(
    eng: Engine, reqs: list[EngineRequest], round_sizes: list[int]
) -> tuple[dict[int, GenerateResult], float, float]:
    """Submit each round at once and wait for it; returns results by index, wall, CPU."""
    results: dict[int, GenerateResult] = {}
    wall = cpu = 0.0
    start = 0
    for n in round_sizes:
        batch = reqs[start : start + n]
        c0 = time.process_time()
        t0 = time.perf_counter()
        batch = [dataclasses.replace(r, arrival=t0) for r in batch]  # submitted at t0
        for i, res in enumerate(eng.generate(batch)):
            results[start + i] = res
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
        start += n
    return results, wall, cpu


def _closed_loop(
    eng: Engine, reqs: list[EngineRequest], sessions: list[list[int]]
) -> tuple[dict[int, GenerateResult], float, float]:
    """Closed-loop chat clients: one outstanding turn per session.

    Turn 0 of every session is submitted at once (in prompt order, i.e. the shuffled
    first round); then ``Engine.step`` runs, and when a session's turn finishes its
    next turn is submitted (``arrival`` = that moment) before the next step.

    Returns:
        ``(results by prompt index, wall seconds, CPU seconds)``.
    """
    nxt: dict[int, int] = {}  # prompt index -> the same session's next turn
    for turns in sessions:
        for a, b in zip(turns, turns[1:], strict=False):
            nxt[a] = b
    index = {r.rid: i for i, r in enumerate(reqs)}
    results: dict[int, GenerateResult] = {}
    collectors = {}
    live = 0

    def submit(i: int) -> None:
        nonlocal live
        reqs[i] = dataclasses.replace(reqs[i], arrival=time.perf_counter())
        collectors[i] = eng.track(reqs[i])
        live += 1

    c0 = time.process_time()
    t0 = time.perf_counter()
    for i in sorted(turns[0] for turns in sessions if turns):
        submit(i)
    while live:
        batch = eng.step()
        if not batch and not eng.has_work():
            break  # nothing runs or waits but turns are outstanding: give up (reported)
        for r in batch:
            i = index[r.rid]
            if collectors[i].finished and i not in results:
                results[i] = collectors[i].result
                live -= 1
                if i in nxt:
                    submit(nxt[i])
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    return results, wall, cpu


def leak_check(eng: Engine) -> tuple[bool, str]:
    """Check pool accounting at a quiescent point, then evict the whole tree.

    Returns:
        ``(ok, note)``: ok when the accounting assertion held, nothing is running
        or waiting, and after evicting every evictable token all pages are free.
    """
    try:
        eng.scheduler.check_accounting()
    except AssertionError as e:
        return False, f"accounting failed: {e}"
    if eng.has_work():
        return False, "requests still waiting or running after generate()"
    if not eng.tree.disable:
        eng.tree.evict(eng.tree.evictable_size())
    free, total = eng.pool.allocator.num_free, eng.pool.num_pages
    if free != total:
        return False, f"{total - free} of {total} pages not free after evicting the tree"
    return True, ""


class _FirstToken:
    """A ``generate`` streamer that records when the first new token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class TransformersRunner:
    """transformers' ``generate`` (``LlavaForConditionalGeneration``,
    ``LlavaNextForConditionalGeneration`` or ``LlavaOnevisionForConditionalGeneration``, as
    the checkpoint says) one request at a time.

    Args:
        model_path: checkpoint directory.
        never_sample_ids: ids mmserve never samples (passed as ``suppress_tokens``
            so both systems pick from the same vocabulary).
    """

    def __init__(self, model_path: str, never_sample_ids: list[int]) -> None:
        from transformers import AutoModelForImageTextToText

        from mmserve.model.loader import load_processor

        self.model = AutoModelForImageTextToText.from_pretrained(model_path).eval()
        # AutoProcessor, or the family's own loading (OneVision's needs no torchvision)
        self.processor = load_processor(model_path)
        self.never = list(never_sample_ids)

    def generate(self, text: str, images: list, max_tokens: int) -> tuple[list[int], float]:
        """One greedy generation; returns ``(output ids, service TTFT seconds)``."""
        t0 = time.perf_counter()
        inputs = self.processor(images=images or None, text=text, return_tensors="pt")
        streamer = _FirstToken()
        with torch.inference_mode():
            out = self.model.generate(
                **inputs,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                suppress_tokens=self.never or None,
                streamer=streamer,
            )
        ids = out[0, inputs["input_ids"].shape[1] :].tolist()
        first = streamer.first or time.perf_counter()
        return ids, first - t0

    def run(
        self,
        wl: Workload,
        render: Any,
        images: dict[str, ImageInput],
        prompt_lens: list[int],
        max_requests: int | None = None,
    ) -> SystemRun:
        """Run ``wl`` (or an evenly spaced subsample of ``max_requests`` requests).

        Args:
            wl: the workload.
            render: ``messages -> prompt text`` (mmserve's chat-template rendering, so
                both systems see the same string).
            images: decoded images by name.
            prompt_lens: mmserve's prompt length of each request (tokens).
            max_requests: run at most this many requests; None runs all.
        """
        n = wl.num_requests
        chosen = set(_spread(n, max_requests))
        outputs: dict[int, list[int]] = {}
        latency: dict[int, float] = {}
        cpu: dict[int, float] = {}
        service: dict[int, float] = {}
        idx = 0
        for rnd in wl.rounds:
            for p in rnd:
                if idx in chosen:
                    c0 = time.process_time()
                    outputs[idx], service[idx], latency[idx] = self._one(wl, p, render, images)
                    cpu[idx] = time.process_time() - c0
                idx += 1
        mean = sum(latency.values()) / len(latency)
        # queueing: request i of a round waits for every request before it in the round
        ttfts = []
        idx = 0
        for rnd in wl.rounds:
            start = 0.0
            for _ in rnd:
                if idx in chosen:
                    ttfts.append(start + service[idx])
                start += latency.get(idx, mean)
                idx += 1
        subsampled = len(chosen) < n
        wall = sum(latency.values()) if not subsampled else mean * n
        cpu_s = sum(cpu.values()) * (n / len(cpu))
        run = SystemRun(
            system="transformers",
            kind="transformers",
            policy=None,
            radix_cache=False,
            pool_tokens=None,
            requests=n,
            measured_requests=len(chosen),
            wall_s=wall,
            cpu_s=cpu_s,
            output_tokens=n * wl.max_tokens,
            prompt_tokens=sum(prompt_lens[i] for i in chosen),
            cached_tokens=0,
            ttfts_s=ttfts,
            service_ttfts_s=[service[i] for i in sorted(chosen)],
            vision_tower_runs=sum(len(p.images) for p in wl.prompts),
            outputs=outputs,
        )
        run.notes.append("TTFT measured with a generate() streamer (first new token)")
        if subsampled:
            run.notes.append(
                f"SUBSAMPLED: ran {len(chosen)} of {n} requests (evenly spaced); wall time "
                f"extrapolated as mean latency x {n}; TTFT queueing uses the mean for the rest"
            )
        return run

    def _one(
        self, wl: Workload, p: Prompt, render: Any, images: dict[str, ImageInput]
    ) -> tuple[list[int], float, float]:
        text = render(p.messages)
        t0 = time.perf_counter()
        ids, ttft = self.generate(text, [images[n].image for n in p.images], wl.max_tokens)
        return ids, ttft, time.perf_counter() - t0


def _spread(n: int, k: int | None) -> list[int]:
    """``k`` evenly spaced indices in ``range(n)`` (all of them if k is None or >= n)."""
    if k is None or k >= n:
        return list(range(n))
    k = max(k, 1)
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})
