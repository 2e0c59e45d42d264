"""The cost bound: the least time any server could take for a burst of a workload here.

Distinct (trie) prompt tokens x per-token prefill cost + distinct images x tower cost +
``ceil(n / B) * (N - 1)`` decode steps at ``B = min(n, max_running_requests)`` x step
cost, each cost measured in-process on the same model (least of the repeats), in wall and
CPU seconds. Per-step overheads are left out, so ``achieved / bound`` <= 1.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from benchmarks.in_process import MMServeRunner, spread
from benchmarks.workloads import Workload, optimal_hit_rate
from mmserve.config import EngineConfig
from mmserve.types import SamplingParams

#: Unit costs that do not depend on the workload (same model, same threads).
SHARED_COSTS = ("prefill_s_per_token", "prefill_cpu_s_per_token", "tower_s_per_image")
SHARED_COSTS += ("tower_cpu_s_per_image",)


def _timed(fn: Any) -> tuple[float, float]:
    """``(wall s, CPU s of this process)`` of ``fn()``."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


class CostModel:
    """Microbenchmarks of one loaded model.

    Args:
        runner: engines on the loaded model (its decoded images are reused).
        reps: repeats per measurement (the least is kept).
    """

    def __init__(self, runner: MMServeRunner, reps: int = 3) -> None:
        self.mm, self.reps = runner, reps
        self.max_running = EngineConfig().max_running_requests

    def _reqs(self, eng: Any, wl: Workload, idx: list[int], max_tokens: int) -> list:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        reqs = self.mm.requests(eng, wl, params)
        return [reqs[i] for i in idx]

    @torch.inference_mode()
    def costs(self, wl: Workload, batch: int) -> dict[str, float]:
        """Per-token prefill, per-image tower and per-step decode costs (wall and CPU s)."""
        best = dict.fromkeys(SHARED_COSTS, math.inf)
        pre, pre_cpu, tow, tow_cpu = SHARED_COSTS
        eng = self.mm.engine(disable_radix_cache=True)
        picks = spread(wl.num_requests, 3)
        eng.generate(self._reqs(eng, wl, picks, 1))  # image features now cached
        for group in [picks[:1]] * self.reps + [picks]:
            reqs = self._reqs(eng, wl, group, 1)
            tokens = sum(len(r.input_ids) for r in reqs)
            wall, cpu = _timed(lambda r=reqs: eng.generate(r))
            best[pre] = min(best[pre], wall / tokens)
            best[pre_cpu] = min(best[pre_cpu], cpu / tokens)
        names = list(dict.fromkeys(n for p in wl.prompts for n in p.images))[:4]
        ims = [self.mm.decoded[wl.images[n]].image for n in names]
        vision = self.mm.model.vision
        if ims:
            vision.encode(ims[:1])  # warm
            for group in [ims[:1]] * self.reps + [ims] * self.reps:
                wall, cpu = _timed(lambda g=group: vision.encode(g))
                best[tow] = min(best[tow], wall / len(group))
                best[tow_cpu] = min(best[tow_cpu], cpu / len(group))
        else:
            best[tow] = best[tow_cpu] = 0.0
        dec, dec_cpu = math.inf, math.inf
        # prefill every request first, then time pure decode steps at the full batch
        eng = self.mm.engine(disable_mixed_steps=True)
        for r in self._reqs(eng, wl, [i % wl.num_requests for i in range(batch)], 9):
            eng.track(r)
        while eng.has_work():
            before = eng.stats.decode_steps
            wall, cpu = _timed(eng.step)
            if eng.stats.decode_steps > before and len(eng.scheduler.running) == batch:
                dec, dec_cpu = min(dec, wall), min(dec_cpu, cpu)
        return {**best, "decode_step_s": dec, "decode_step_cpu_s": dec_cpu, "decode_batch": batch}

    def bound(self, wl: Workload) -> dict[str, Any]:
        """The workload's bound for a burst (every request known at time 0)."""
        t0 = time.perf_counter()
        opt = optimal_hit_rate(self.mm.prompt_ids(wl))
        n = wl.num_requests
        keys = [self.mm.decoded[wl.images[m]].key for p in wl.prompts for m in p.images]
        batch = min(n, self.max_running)
        out = {
            "requests": n,
            "max_tokens": wl.max_tokens,
            "prompt_tokens": opt["total_tokens"],
            "distinct_prompt_tokens": opt["distinct_tokens"],
            "optimal_hit_rate": opt["optimal_hit_rate"],
            "images": len(keys),
            "distinct_images": len(set(keys)),
            "decode_steps": math.ceil(n / batch) * (wl.max_tokens - 1),
            **self.costs(wl, batch),
        }
        out["microbenchmark_s"] = time.perf_counter() - t0
        return totals(out)


def totals(b: dict[str, Any]) -> dict[str, Any]:
    """Fill ``b``'s ``prefill_s``, ``tower_s``, ``decode_s``, ``bound_s``, ``bound_cpu_s``
    and ``max_speedup_from_reuse`` (the bound without reuse over the bound) from its counts
    and unit costs."""
    b["prefill_s"] = b["distinct_prompt_tokens"] * b["prefill_s_per_token"]
    b["tower_s"] = b["distinct_images"] * b["tower_s_per_image"]
    b["decode_s"] = b["decode_steps"] * b["decode_step_s"]
    b["bound_s"] = b["prefill_s"] + b["tower_s"] + b["decode_s"]
    cpu = ("prefill_cpu_s_per_token", "tower_cpu_s_per_image", "decode_step_cpu_s")
    counts = ("distinct_prompt_tokens", "distinct_images", "decode_steps")
    b["bound_cpu_s"] = sum(b[n] * b[c] for n, c in zip(counts, cpu, strict=True))
    no_reuse = b["prompt_tokens"] * b["prefill_s_per_token"] + b["decode_s"]
    no_reuse += b["images"] * b["tower_s_per_image"]
    b["max_speedup_from_reuse"] = no_reuse / b["bound_s"] if b["bound_s"] else None
    return b


def share_costs(bounds: list[dict[str, Any]]) -> None:
    """Give every bound the least of each :data:`SHARED_COSTS` over ``bounds`` (keeping its
    own as ``own_<key>``), then recompute its totals."""
    for key in SHARED_COSTS:
        vals = [b[key] for b in bounds if b.get(key)]
        for b in bounds:
            b[f"own_{key}"] = b[key]
            b[key] = min(vals, default=b[key])
    for b in bounds:
        totals(b)
