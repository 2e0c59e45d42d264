"""The cost bound: the least time any server could take for a workload on this machine.

With every repeated piece of work skipped (SGLang's offline optimum, arXiv 2312.07104,
Theorem 3.1) a workload still needs

- a prefill of every *distinct* prompt token: the nodes of the token trie of all
  prompts (image pseudo-tokens included), times the per-token prefill cost;
- one vision-tower pass (preprocessing, CLIP, projector) per *distinct* image, times
  the per-image tower cost;
- ``max_tokens - 1`` decode steps per request (the first token comes with the
  prefill), at the batch sizes the load allows: a burst puts every request in one
  batch (up to ``max_running_requests``), so ``ceil(n / B) * (N - 1)`` steps at
  batch size ``B = min(n, max_running_requests)``, each at the measured step cost.

Each cost comes from a microbenchmark of the same model in the same run, through
mmserve's engine in-process (:class:`~mmserve.engine.engine.Engine`, its processor and
model runner), minimum over repeats (a bound takes the least):

- prefill: a prompt of the workload whose image features are already in the embedding
  cache and whose KV is not (radix cache off), ``max_tokens = 1``: the step time over
  its tokens, one prompt (``reps`` times) and a batch of three, the lower figure;
- tower: ``model.vision.encode`` of the workload's images, one at a time and as a batch;
- decode: ``B`` of the workload's prompts prefilled, then the time of each decode step
  (the last steps run at a smaller batch as requests finish; only full-batch steps count).

Every cost is measured in wall time and in this process's CPU time (one torch
thread, like the servers): ``bound_s`` and ``bound_cpu_s``. On a shared machine the
CPU figures are the steadier ones (other processes inflate wall time, not CPU time);
they compare with the server process's CPU seconds.

:func:`share_costs` then gives every workload of a run the least per-token prefill and
per-image tower cost measured on any of them (the same model; a measurement that
other load slowed down must not raise a bound); decode step costs stay per workload
(they depend on the batch size and the context lengths).

The bound ignores per-step overheads (scheduling, sampling, the HTTP layer) and
assumes prefill and decode never wait for each other, so no real server reaches it;
``achieved / bound`` is the bound's time over the server's time (1.0 = at the bound).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from benchmarks.workloads import Workload, optimal_hit_rate
from mmserve.config import EngineConfig
from mmserve.engine.engine import Engine
from mmserve.engine.request import ImageInput, Request, SamplingParams
from mmserve.model.loader import LoadedModel


class CostModel:
    """Microbenchmarks of one loaded model (engines share its weights).

    Args:
        model: the loaded checkpoint.
        model_dir: its directory.
        reps: repeats per measurement (the minimum is kept).
    """

    def __init__(self, model: LoadedModel, model_dir: str, reps: int = 3) -> None:
        self.model = model
        self.model_dir = model_dir
        self.reps = reps
        self.max_running = EngineConfig().max_running_requests
        self._images: dict[bytes, ImageInput] = {}

    def engine(self, **kw: Any) -> Engine:
        """A fresh engine, radix cache off, embedding cache on."""
        cfg = EngineConfig(model_path=self.model_dir, disable_radix_cache=True, **kw)
        return Engine(cfg, model=self.model)

    def _image(self, eng: Engine, data: bytes) -> ImageInput:
        if data not in self._images:
            self._images[data] = eng.processor.prepare_image(data)
        return self._images[data]

    def requests(self, eng: Engine, wl: Workload, idx: list[int], max_tokens: int) -> list[Request]:
        """Engine requests for prompts ``idx`` of ``wl`` (greedy, ignore_eos)."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompts = wl.prompts
        return [
            eng.processor.make_request(
                messages=prompts[i].messages,
                images=[self._image(eng, wl.images[n]) for n in prompts[i].images],
                params=params,
            )
            for i in idx
        ]

    @torch.inference_mode()
    def prefill_per_token(self, wl: Workload) -> dict[str, float]:
        """Seconds per prompt token of a prefill whose image features are cached."""
        eng = self.engine()
        picks = _spread(wl.num_requests, 3)
        eng.generate(self.requests(eng, wl, picks, 1))  # warm: image features cached
        best, best_cpu = math.inf, math.inf
        for group in [picks[:1]] * self.reps + [picks]:
            reqs = self.requests(eng, wl, group, 1)
            tokens = sum(len(r.input_ids) for r in reqs)
            wall, cpu = _timed(lambda r=reqs: eng.generate(r))
            best, best_cpu = min(best, wall / tokens), min(best_cpu, cpu / tokens)
        return {"prefill_s_per_token": best, "prefill_cpu_s_per_token": best_cpu}

    @torch.inference_mode()
    def tower_per_image(self, wl: Workload) -> dict[str, float]:
        """Seconds per image of the vision tower (preprocessing + CLIP + projector)."""
        eng = self.engine()
        names = list(dict.fromkeys(n for p in wl.prompts for n in p.images))[:4]
        ims = [self._image(eng, wl.images[n]).image for n in names]
        if not ims:
            return {"tower_s_per_image": 0.0, "tower_cpu_s_per_image": 0.0}
        self.model.vision.encode(ims[:1])  # warm
        best, best_cpu = math.inf, math.inf
        for group in [ims[:1], ims]:
            for _ in range(self.reps):
                wall, cpu = _timed(lambda g=group: self.model.vision.encode(g))
                best, best_cpu = min(best, wall / len(group)), min(best_cpu, cpu / len(group))
        return {"tower_s_per_image": best, "tower_cpu_s_per_image": best_cpu}

    @torch.inference_mode()
    def decode_step(self, wl: Workload, batch: int, steps: int = 8) -> dict[str, float]:
        """Seconds of one decode step with ``batch`` of the workload's requests running.

        The requests are prefilled with the radix cache on (sharing only speeds up the
        setup: each request still attends to its whole context); the minimum over
        ``steps`` decode steps at full batch is kept.
        """
        eng = Engine(EngineConfig(model_path=self.model_dir), model=self.model)
        idx = [i % wl.num_requests for i in range(batch)]
        best, best_cpu = math.inf, math.inf
        for r in self.requests(eng, wl, idx, steps + 1):
            eng.track(r)
        while eng.has_work():
            before = eng.stats.decode_steps
            wall, cpu = _timed(eng.step)
            if eng.stats.decode_steps > before and len(eng.scheduler.running) == batch:
                best, best_cpu = min(best, wall), min(best_cpu, cpu)
        return {"decode_step_s": best, "decode_step_cpu_s": best_cpu, "decode_batch": batch}

    def bound(self, wl: Workload, prompt_ids: list[list[int]]) -> dict[str, Any]:
        """The workload's cost bound (burst: every request known at time 0).

        Args:
            prompt_ids: every request's prompt ids with image pseudo-tokens (mmserve's).
        """
        t0 = time.perf_counter()
        opt = optimal_hit_rate(prompt_ids)
        n = wl.num_requests
        keys = [self._image(self.engine(), wl.images[m]).key for p in wl.prompts for m in p.images]
        distinct_images = len(set(keys))
        batch = min(n, self.max_running)
        costs = {
            **self.prefill_per_token(wl),
            **self.tower_per_image(wl),
            **self.decode_step(wl, batch),
        }
        steps = math.ceil(n / batch) * (wl.max_tokens - 1)
        out = {
            "requests": n,
            "max_tokens": wl.max_tokens,
            "prompt_tokens": opt["total_tokens"],
            "distinct_prompt_tokens": opt["distinct_tokens"],
            "optimal_hit_rate": opt["optimal_hit_rate"],
            "images": len(keys),
            "distinct_images": distinct_images,
            "decode_steps": steps,
            **costs,
            "microbenchmark_s": time.perf_counter() - t0,
        }
        return totals(out)


def totals(b: dict[str, Any]) -> dict[str, Any]:
    """Fill ``b``'s bound (``prefill_s``, ``tower_s``, ``decode_s``, ``bound_s``,
    ``bound_cpu_s``, the no-reuse bound) from its counts and per-unit costs."""
    b["prefill_s"] = b["distinct_prompt_tokens"] * b["prefill_s_per_token"]
    b["tower_s"] = b["distinct_images"] * b["tower_s_per_image"]
    b["decode_s"] = b["decode_steps"] * b["decode_step_s"]
    b["bound_s"] = b["prefill_s"] + b["tower_s"] + b["decode_s"]
    b["bound_cpu_s"] = (
        b["distinct_prompt_tokens"] * b["prefill_cpu_s_per_token"]
        + b["distinct_images"] * b["tower_cpu_s_per_image"]
        + b["decode_steps"] * b["decode_step_cpu_s"]
    )
    b["no_reuse_bound_s"] = (
        b["prompt_tokens"] * b["prefill_s_per_token"]
        + b["images"] * b["tower_s_per_image"]
        + b["decode_s"]
    )
    b["max_speedup_from_reuse"] = b["no_reuse_bound_s"] / b["bound_s"] if b["bound_s"] else None
    return b


#: Per-unit costs that do not depend on the workload (same model, same threads).
SHARED_COSTS = (
    "prefill_s_per_token",
    "prefill_cpu_s_per_token",
    "tower_s_per_image",
    "tower_cpu_s_per_image",
)


def share_costs(bounds: list[dict[str, Any]]) -> None:
    """Give every bound the least per-token prefill and per-image tower costs measured
    on any workload of the run (the model is the same; a measurement that other load
    on the machine slowed down must not raise a bound), then recompute the totals."""
    real = [b for b in bounds if b.get("distinct_images") or b.get("prompt_tokens")]
    for key in SHARED_COSTS:
        vals = [b[key] for b in real if b.get(key)]
        if not vals:
            continue
        for b in real:
            b[f"own_{key}"] = b[key]
            b[key] = min(vals)
    for b in real:
        totals(b)


def _timed(fn: Any) -> tuple[float, float]:
    """``(wall seconds, CPU seconds of this process)`` of ``fn()``."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _spread(n: int, k: int) -> list[int]:
    """``k`` evenly spaced indices in ``range(n)`` (fewer if n < k)."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})
