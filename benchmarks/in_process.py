"""The in-process runner: workloads on mmserve's :class:`Engine` (fresh engines over one
loaded model; lock-step rounds, closed-loop sessions, or arrival times with the server's
front-end work at each arrival) and on transformers' ``generate`` one request at a time.
TTFT counts from submission (queueing included); CPU times are ``time.process_time``."""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.report import md_table, percentiles
from benchmarks.workloads import Workload, optimal_hit_rate
from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
from mmserve.model.loader import LoadedModel, load_model
from mmserve.types import EngineRequest, GenerateResult, SamplingParams
from mmserve.vision.inputs import ImageInput

#: ``EngineConfig`` fields of "cache off": no KV and no image features reused.
CACHE_OFF = {"disable_radix_cache": True, "vision_cache_bytes": 0}


def model_dir(
    size: str = "tiny", family: str = "llava", path: Any = None, revision: str | None = None
) -> str:
    """``path`` (a directory, or a Hub id resolved to its local snapshot at ``revision``:
    :func:`~mmserve.model.hub.resolve_model`), else the seeded random checkpoint of
    ``size`` and ``family`` (built once)."""
    if path:
        from mmserve.model.hub import resolve_model

        return str(resolve_model(str(path), revision).path)
    from mmserve.testing.checkpoints import ensure_model

    return str(ensure_model(size, family))


@dataclass
class Run:
    """One system on one workload (seconds; CPU: this process, all threads).

    ``measured_requests`` < ``requests``: a subsampled baseline (``wall_s``, ``cpu_s``
    extrapolated); ``outputs``: token ids by request index; ``leak_free``: accounting held
    and every page was free after evicting the tree (None: not checked); ``steps``:
    prefill/decode step counts and seconds; ``decode_times``: each decode step's
    ``(wall, CPU)`` seconds.
    """

    system: str
    kind: str
    requests: int
    wall_s: float
    cpu_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    vision_tower_runs: int
    measured_requests: int = 0
    pool_tokens: int | None = None
    image_prefills: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    tpots_s: list[float] = field(default_factory=list)
    tree_seconds: float = 0.0
    outputs: dict[int, list[int]] = field(default_factory=dict)
    all_finished: bool = True
    leak_free: bool | None = None
    retractions: int = 0
    steps: dict[str, float] = field(default_factory=dict)
    decode_times: list[tuple[float, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures: the fields without per-request lists, plus rates."""
        d = dataclasses.asdict(self)
        for k in ("outputs", "ttfts_s", "tpots_s", "decode_times"):
            del d[k]
        per = lambda x, t: x / t if t > 0 else 0.0  # noqa: E731
        ttft = percentiles(self.ttfts_s)
        return d | dict(
            requests_per_s=per(self.requests, self.wall_s),
            requests_per_cpu_s=per(self.requests, self.cpu_s),
            output_tokens_per_s=per(self.output_tokens, self.wall_s),
            cache_hit_rate=per(self.cached_tokens, self.prompt_tokens),
            tree_fraction=per(self.tree_seconds, self.wall_s),
            ttft_p50_s=ttft["p50"],
            ttft_p90_s=ttft["p90"],
            ttft_p99_s=ttft["p99"],
            tpot_p50_s=percentiles(self.tpots_s)["p50"],
        )


def leak_check(eng: Engine) -> tuple[bool, str]:
    """At a quiescent point: accounting holds, nothing waits, and after evicting the whole
    tree every page is free. Returns ``(ok, why not)``."""
    try:
        eng.scheduler.check_accounting()
    except AssertionError as e:
        return False, f"accounting failed: {e}"
    if eng.has_work():
        return False, "requests still waiting or running"
    eng.tree.evict(eng.tree.evictable_size())  # a no-op for the disabled (no-op) cache
    free, total = eng.pool.allocator.num_free, eng.pool.num_pages
    return free == total, "" if free == total else f"{total - free} of {total} pages not free"


class MMServeRunner:
    """Runs workloads on fresh engines sharing one loaded model (``model``, read-only, from
    ``model_path``); ``engine_kwargs``: ``EngineConfig`` fields of every engine."""

    def __init__(self, model: LoadedModel, model_path: str, **engine_kwargs: Any) -> None:
        self.model, self.model_path, self.engine_kwargs = model, model_path, engine_kwargs
        self.decoded: dict[bytes, ImageInput] = {}  # decoded, hashed images by encoded bytes
        self.last_engine: Engine | None = None  # the engine of the latest run (its stats)

    @classmethod
    def load(cls, path: str, **engine_kwargs: Any) -> MMServeRunner:
        """A runner on the checkpoint at ``path``, loaded in fp32 (or ``dtype``), quantized
        as ``quantization`` says (default none)."""
        dtype, quantization = engine_kwargs.get("dtype"), engine_kwargs.get("quantization")
        model = load_model(
            path, dtype=getattr(torch, dtype or "float32"), quantization=quantization or "none"
        )
        return cls(model, path, **engine_kwargs)

    def engine(self, **kw: Any) -> Engine:
        """A fresh engine (empty pool, tree and embedding cache)."""
        cfg = EngineConfig(model_path=self.model_path, **{**self.engine_kwargs, **kw})
        return Engine(cfg, model=self.model)

    def requests(
        self, eng: Engine, wl: Workload, params: SamplingParams | None = None, cached: bool = True
    ) -> list[EngineRequest]:
        """Engine requests of every prompt (greedy, ``ignore_eos``, ``wl.max_tokens`` by
        default); images decoded and hashed once per runner unless ``cached`` is False."""
        params = params or SamplingParams(
            max_tokens=wl.max_tokens, temperature=0.0, ignore_eos=True
        )
        prepare, out = eng.processor.prepare_image, []
        for p in wl.prompts:
            data = [wl.images[n] for n in p.images]
            if cached:
                self.decoded.update({d: prepare(d) for d in data if d not in self.decoded})
            imgs = [self.decoded[d] if cached else prepare(d) for d in data]
            out.append(eng.processor.make_request(messages=p.messages, images=imgs, params=params))
        return out

    def prompt_ids(self, wl: Workload) -> list[list[int]]:
        """Every prompt's token ids, image pseudo-ids included."""
        eng = self.engine(**CACHE_OFF)
        return [r.input_ids for r in self.requests(eng, wl, SamplingParams(max_tokens=1))]

    def optimum(self, wl: Workload) -> float:
        """The offline-optimal hit rate of ``wl``'s prompts."""
        return optimal_hit_rate(self.prompt_ids(wl))["optimal_hit_rate"]

    def run(
        self,
        wl: Workload,
        label: str,
        *,
        radix_cache: bool = True,
        closed_loop: bool | None = None,
        arrivals: list[float] | None = None,
        check_leaks: bool = True,
        **engine_kw: Any,
    ) -> Run:
        """Run ``wl`` on a fresh engine and measure it.

        Args:
            closed_loop: drive ``wl.sessions`` closed-loop (None: when it has sessions);
                False: lock-step rounds.
            arrivals: submit request ``i`` at ``arrivals[i]`` seconds, doing the front-end
                work then (overrides ``closed_loop``).
            engine_kw: more ``EngineConfig`` fields (``policy``, ``max_total_tokens``, ...).
        """
        closed_loop = bool(wl.sessions) if closed_loop is None else closed_loop
        eng = self.engine(**({} if radix_cache else CACHE_OFF), **engine_kw)
        n = wl.num_requests
        if arrivals is not None:
            build = lambda i: self.requests(eng, one_request(wl, i), cached=False)[0]  # noqa: E731
            got = _drive(eng, build, [range(n)], {}, arrivals)
        else:
            reqs = self.requests(eng, wl)
            if closed_loop:
                nxt = {a: b for s in wl.sessions for a, b in zip(s, s[1:], strict=False)}
                got = _drive(eng, reqs.__getitem__, [sorted(s[0] for s in wl.sessions)], nxt)
            else:
                ends = list(itertools.accumulate(len(r) for r in wl.rounds))
                groups = [range(a, b) for a, b in zip([0, *ends], ends, strict=False)]
                got = _drive(eng, reqs.__getitem__, groups, {})
        results, wall, cpu, steps, times = got
        res = [results[i] for i in sorted(results)]
        stats = eng.cache_stats()
        tokens = [
            sum(getattr(r, f"{k}_tokens") for r in res) for k in ("completion", "prompt", "cached")
        ]
        towers = int(stats["vision_tower_images"])
        run = Run(label, "mmserve", n, wall, cpu, *tokens, towers, measured_requests=n)
        run.pool_tokens, run.steps, run.decode_times = eng.pool.size_tokens, steps, times
        run.image_prefills = sum(r.images_needing_vision for r in res)
        run.ttfts_s = [r.ttft for r in res]
        run.tpots_s = [
            (r.latency - r.ttft) / (r.completion_tokens - 1) for r in res if r.completion_tokens > 1
        ]
        run.tree_seconds = float(stats.get("tree_seconds", 0.0))
        run.outputs = {i: list(r.output_ids) for i, r in results.items()}
        run.all_finished = len(res) == n and all(r.finish_reason == "length" for r in res)
        run.retractions = int(stats.get("retractions", 0))
        if closed_loop and arrivals is None:
            run.notes.append(
                f"closed loop: {len(wl.sessions)} sessions start at once; each sends its next "
                "request when its previous answer arrives; TTFT from each one's submission"
            )
        if check_leaks:
            run.leak_free, note = leak_check(eng)
            run.notes += [note] if note else []
        self.last_engine = eng
        return run


def one_request(wl: Workload, i: int) -> Workload:
    """Request ``i`` of ``wl`` alone (same images and ``max_tokens``)."""
    return Workload(wl.name, "", wl.images, [[wl.prompts[i]]], wl.max_tokens)


def _drive(
    eng: Engine, build: Any, groups: list[Any], nxt: dict[int, int], at: list[float] | None = None
) -> tuple[dict[int, GenerateResult], float, float, dict[str, float], list]:
    """Step ``eng`` over request groups, one group at a time (a lock-step round). Within a
    group, request ``build(i)`` is submitted at once (or at ``at[i]`` seconds after the
    start) and ``nxt[i]`` as soon as ``i`` finishes (before the next step).

    Returns:
        ``(results by index, wall s, CPU s, steps, decode step times)``; ``steps`` counts
        prefill and decode steps, their seconds, and decode rows (mean batch = rows / steps);
        the times are ``(wall, CPU)`` seconds per decode step.
    """
    results: dict[int, GenerateResult] = {}
    steps = dict(prefill=0, prefill_s=0.0, decode=0, decode_s=0.0, decode_rows=0)
    times: list[tuple[float, float]] = []
    wall = cpu = 0.0
    for group in groups:
        pending = sorted(group, key=lambda i: at[i] if at else 0.0)
        cols, index = {}, {}
        c0, t0 = time.process_time(), time.perf_counter()
        while True:
            now = time.perf_counter() - t0
            while pending and (at is None or at[pending[0]] <= now):
                i = pending.pop(0)
                arrival = t0 + at[i] if at else time.perf_counter()
                req = dataclasses.replace(build(i), arrival=arrival)
                index[req.rid], cols[i] = i, eng.track(req)
            if not eng.has_work():
                if not pending or at is None:
                    break  # done (or, closed loop, nothing left to run: reported as unfinished)
                time.sleep(max(0.0, at[pending[0]] - (time.perf_counter() - t0)))
                continue
            pre, s0, sc = eng.stats.prefill_steps, time.perf_counter(), time.process_time()
            batch = eng.step()
            kind = "prefill" if eng.stats.prefill_steps > pre else "decode"
            steps[kind] += 1
            steps[f"{kind}_s"] += time.perf_counter() - s0
            if kind == "decode":
                steps["decode_rows"] += len(batch)
                times.append((time.perf_counter() - s0, time.process_time() - sc))
            for r in batch:
                i = index.get(r.rid)
                if i is not None and cols[i].finished and i not in results:
                    results[i] = cols[i].result
                    pending += [nxt[i]] if i in nxt else []
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
    return results, wall, cpu, steps, times


class TransformersRunner:
    """transformers' ``generate`` (the class the checkpoint names) one request at a time, in
    ``dtype`` (mmserve's, so both run the same arithmetic), with mmserve's
    ``never_sample_ids`` as ``suppress_tokens``."""

    def __init__(self, model_path: str, never_sample_ids: list[int], dtype: torch.dtype) -> None:
        from transformers import AutoModelForImageTextToText

        from mmserve.model.loader import load_processor

        self.model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype).eval()
        self.processor = load_processor(model_path)  # OneVision's needs no torchvision
        self.never = list(never_sample_ids) or None

    def inputs(self, text: str, images: list[Any]) -> Any:
        """Processor outputs for ``text`` and PIL ``images``, pixels in the model's dtype."""
        inputs = self.processor(images=images or None, text=text, return_tensors="pt")
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        return inputs

    @torch.inference_mode()
    def generate(self, text: str, images: list[Any], n: int, **kw: Any) -> tuple[list, list]:
        """``n`` greedy tokens for ``text`` and ``images``: ``(new token ids, (wall, CPU) of
        the start and of each token)``."""
        t0, t = (time.perf_counter(), time.process_time()), []
        stamp = lambda _: t.append((time.perf_counter(), time.process_time()))  # noqa: E731
        stamps = SimpleNamespace(put=stamp, end=lambda: None)  # a streamer: times of each put
        inputs = kw.pop("inputs", None) or self.inputs(text, images)
        ids = self.model.generate(
            **inputs,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            suppress_tokens=self.never,
            streamer=stamps,
            **kw,
        )
        return ids[0, inputs["input_ids"].shape[1] :].tolist(), [t0, *t[1:]]  # t[0]: the prompt

    def run(
        self, wl: Workload, render: Any, images: dict[str, Any], lens: list[int], most: Any = None
    ) -> Run:
        """Run ``wl`` (or ``most`` evenly spaced requests of it, wall time extrapolated);
        ``render``: messages -> prompt text (mmserve's template), ``images``: PIL images by
        name, ``lens``: mmserve's prompt length of each request."""
        n = wl.num_requests
        chosen = spread(n, most)
        out, lat, cpu, service = {}, {}, {}, {}
        for i in chosen:
            p = wl.prompts[i]
            out[i], t = self.generate(
                render(p.messages), [images[m] for m in p.images], wl.max_tokens
            )
            end = (time.perf_counter(), time.process_time())
            lat[i], cpu[i], service[i] = end[0] - t[0][0], end[1] - t[0][1], t[1][0] - t[0][0]
        mean = sum(lat.values()) / len(lat)
        ttfts, i = [], 0
        for rnd in wl.rounds:  # queueing: request i of a round waits for those before it
            start = 0.0
            for _ in rnd:
                if i in lat:
                    ttfts.append(start + service[i])
                start, i = start + lat.get(i, mean), i + 1
        wall = mean * n if len(chosen) < n else sum(lat.values())
        towers, prompt = sum(len(p.images) for p in wl.prompts), sum(lens[i] for i in chosen)
        cpu_s, tokens = sum(cpu.values()) * n / len(cpu), n * wl.max_tokens
        run = Run("transformers", "transformers", n, wall, cpu_s, tokens, prompt, 0, towers)
        run.measured_requests, run.ttfts_s, run.outputs = len(chosen), ttfts, out
        if len(chosen) < n:
            run.notes.append(
                f"SUBSAMPLED: ran {len(chosen)} of {n} requests (evenly spaced); wall time "
                f"extrapolated as mean latency x {n}"
            )
        return run


def spread(n: int, k: int | None) -> list[int]:
    """``k`` evenly spaced indices of ``range(n)`` (all of them when k is None or >= n)."""
    if k is None or k >= n:
        return list(range(n))
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(max(k, 1))})


def cache_on_off(path: str, wl: Workload, **engine_kw: Any) -> dict[str, Any]:
    """``wl`` on one loaded model with the caches on, then off (after an untimed warm-up),
    as the GPU check runs it; prints the side-by-side table. ``engine_kw``: ``EngineConfig``
    fields (``device``, ``dtype``, ``attention_backend``).

    Returns:
        ``{"config", "on", "off", "ratio"}``: the two runs' summaries and on / off per figure.
    """
    from mmserve.kernels.select import resolve_attention_backend

    cfg = EngineConfig(model_path=path, **engine_kw)
    cfg.validate()
    model = load_model(path, device=cfg.device, dtype=cfg.torch_dtype())
    mm = MMServeRunner(model, path, **engine_kw)
    mm.run(one_request(wl, 0), "warm-up", check_leaks=False)
    on, off = mm.run(wl, "on").summary(), mm.run(wl, "off", radix_cache=False).summary()
    backend = resolve_attention_backend(
        cfg.attention_backend, cfg.device, model.decoder.embed_tokens.weight.dtype
    )
    config = {"model": path, **wl.params, "attention_backend": backend, **engine_kw}
    ratio = {k: on[k] / off[k] if isinstance(on[k], float | int) and off[k] else None for k in on}
    keys = "requests_per_s output_tokens_per_s ttft_p50_s cache_hit_rate vision_tower_runs"
    rows = [(k, on[k], off[k], ratio[k]) for k in (keys + " image_prefills wall_s").split()]
    print(f"{wl.name}: {wl.description}; {config}\n" + md_table("|cache on|cache off|on/off", rows))
    return {"config": config, "on": on, "off": off, "ratio": ratio}
