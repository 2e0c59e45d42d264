"""``python -m benchmarks kv-fp8``: the fp8 KV cache (``--kv-cache-dtype fp8_e4m3``)
against bf16 KV, side by side in one run.

* capacity: distinct photos whose image KV stays in the pool, one question each, in a
  fixed ``--kv-cache-memory`` (the bf16 pool at the model's context, the smallest a
  memory budget may give); counted with the radix tree's ``match_prefix`` at the end;
* hit rate: questions about ``--over`` x as many photos as the bf16 pool holds,
  photos drawn with Zipf(1) popularity (seeded), one request at a time, same budget;
* quality: teacher-forced logits at the text positions after an image (question and a
  fixed answer text, ~``--positions`` in all) with fp8 KV vs bf16 KV (and vs fp32 KV
  with an fp32 model): top-1 agreement and mean KL(reference || fp8) in nats.

Capacity and hit rate run on ``--pool-size`` (tiny: the pool ratio does not depend on
the model, and its tower is quick); quality on ``--size`` (small).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from typing import Any

import torch

from benchmarks import report, workloads
from benchmarks.in_process import model_dir as checkpoint
from mmserve.cache.kv_pool import kv_bytes_per_token
from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
from mmserve.model.loader import load_model
from mmserve.types import SamplingParams

#: Assistant text of the quality prompts (teacher-forced; its content does not matter).
ANSWER = (
    "The photo shows a small scene in daylight. In the foreground there is an object with "
    "a clear outline and some texture; behind it the background is softer, with muted "
    "colours and a few shapes that could be furniture, plants or a wall. The light comes "
    "from the left, so shadows fall to the right. Nothing in the picture moves, and no "
    "text is visible. Overall it looks like an ordinary photograph taken at home. "
)


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0.0)


def _image_end(ids: list[int]) -> int:
    """One past the last image pseudo-token (negative ids) of a prompt."""
    return max(i for i, t in enumerate(ids) if t < 0) + 1


def _ask(eng: Engine, img: Any, question: str) -> Any:
    req = eng.processor.make_request(
        messages=workloads.ask(question, system=False), images=[img], params=_greedy()
    )
    return req, eng.generate([req])[0]


def _budget_engine(model: Any, path: str, memory: int, kv: str) -> Engine:
    """A bf16 engine whose pool is sized by ``--kv-cache-memory memory`` in ``kv``."""
    cfg = EngineConfig(
        model_path=path, dtype="bfloat16", kv_cache_dtype=kv, page_size=16, kv_cache_memory=memory
    )
    return Engine(cfg, model=model)


def capacity(model: Any, path: str, memory: int, images: list[bytes]) -> dict[str, Any]:
    """Distinct photos whose image KV is in the pool after asking about each in turn."""
    out: dict[str, Any] = {}
    for name, kv in (("bf16", "auto"), ("fp8", "fp8_e4m3")):
        eng = _budget_engine(model, path, memory, kv)
        P, prompts = eng.pool.page_size, []
        t0 = time.perf_counter()
        for data in images:
            req, _ = _ask(eng, eng.processor.prepare_image(data), "What is this?")
            prompts.append(list(req.input_ids))
        resident = sum(
            eng.tree.match_prefix(ids).length >= _image_end(ids) // P * P for ids in prompts
        )
        out[name] = {
            "pool_tokens": eng.pool.size_tokens,
            "kv_bytes_per_token": eng.pool.bytes_per_token(),
            "pool_mib": eng.pool.size_tokens * eng.pool.bytes_per_token() / 2**20,
            "images_resident": resident,
            "tokens_per_image": len(prompts[0]),
            "seconds": time.perf_counter() - t0,
        }
    out["ratio"] = out["fp8"]["images_resident"] / max(1, out["bf16"]["images_resident"])
    return out


def hit_rate(
    model: Any, path: str, memory: int, images: list[bytes], requests: int, seed: int
) -> dict[str, Any]:
    """Hit rate of Zipf-popular photo questions over a working set larger than the pool."""
    rnd = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(len(images))]
    order = rnd.choices(range(len(images)), weights=weights, k=requests)
    questions = [workloads.QUESTIONS[rnd.randrange(len(workloads.QUESTIONS))] for _ in order]
    out: dict[str, Any] = {"images": len(images), "requests": requests}
    for name, kv in (("bf16", "auto"), ("fp8", "fp8_e4m3")):
        eng = _budget_engine(model, path, memory, kv)
        prepared: dict[int, Any] = {}
        t0 = time.perf_counter()
        for i, q in zip(order, questions, strict=True):
            if i not in prepared:
                prepared[i] = eng.processor.prepare_image(images[i])
            _ask(eng, prepared[i], q)
        st = eng.cache_stats()
        out[name] = {
            "cache_hit_rate": st["cache_hit_rate"],
            "vision_tower_images": st["vision_tower_images"],
            "pool_tokens": eng.pool.size_tokens,
            "seconds": time.perf_counter() - t0,
        }
    out["ratio"] = out["fp8"]["cache_hit_rate"] / max(1e-9, out["bf16"]["cache_hit_rate"])
    return out


def _teacher_forced(eng: Engine, prompts: list[tuple[Any, str]]) -> list[torch.Tensor]:
    """Per prompt, fp32 logits ``[n, vocab]`` at every text position after its image (row
    ``t`` predicts token ``t + 1``), from one forward over the whole prompt."""
    runner, got = eng.runner, []
    run = runner._run

    def all_rows(meta, embeds):
        # the step's metadata with every token's row wanted, not only each request's last
        rows = meta.logit_rows
        every = torch.arange(embeds.shape[0], dtype=torch.int64, device=embeds.device)
        full = run(dataclasses.replace(meta, logit_rows=every), embeds)
        got.append(full)
        return full[rows]

    runner._run = all_rows
    out = []
    try:
        for img, question in prompts:
            got.clear()
            msgs = [
                *workloads.ask(question, system=False),
                {"role": "assistant", "content": ANSWER},
            ]
            req = eng.processor.make_request(messages=msgs, images=[img], params=_greedy())
            eng.generate([req])
            logits = torch.cat(got)  # prefill chunks in order
            ids = list(req.input_ids)
            out.append(logits[_image_end(ids) : len(ids) - 1])
    finally:
        runner._run = run
    return out


def _agreement(ref: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement and KL(ref || other) (nats) of two ``[n, vocab]`` logit rows."""
    live = torch.isfinite(ref[0])  # never-sampled ids are -inf in both
    logp, logq = ref[:, live].log_softmax(-1), other[:, live].log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return {
        "positions": ref.shape[0],
        "top1_agreement": (ref.argmax(-1) == other.argmax(-1)).float().mean().item(),
        "mean_kl": kl.mean().item(),
        "max_kl": kl.max().item(),
    }


def quality(path: str, images: list[bytes], positions: int) -> dict[str, Any]:
    """Top-1 agreement and mean KL of fp8 KV against KV in the model's dtype (bf16, fp32),
    and of the bf16 model against the fp32 one for scale."""
    out: dict[str, Any] = {}
    refs: dict[str, torch.Tensor] = {}
    for dtype in ("bfloat16", "float32"):
        model = load_model(path, dtype=getattr(torch, dtype))
        runs = {}
        for kv in ("auto", "fp8_e4m3"):
            eng = Engine(
                EngineConfig(
                    model_path=path, dtype=dtype, kv_cache_dtype=kv, disable_radix_cache=True,
                    max_prefill_tokens=16384, max_total_tokens=16384,
                ),
                model=model,
            )  # fmt: skip
            prompts, n = [], 0
            while n < positions:  # whole prompts until the positions are reached
                k = len(prompts)
                img = eng.processor.prepare_image(images[k % len(images)])
                question = workloads.QUESTIONS[k % len(workloads.QUESTIONS)]
                msgs = [
                    *workloads.ask(question, system=False),
                    {"role": "assistant", "content": ANSWER},
                ]
                ids = list(eng.processor.make_request(messages=msgs, images=[img]).input_ids)
                n += len(ids) - 1 - _image_end(ids)
                prompts.append((img, question))
            runs[kv] = _teacher_forced(eng, prompts)
        name = "bf16" if dtype == "bfloat16" else "fp32"
        refs[name] = torch.cat(runs["auto"])
        out[f"fp8 KV vs {name} KV"] = _agreement(refs[name], torch.cat(runs["fp8_e4m3"]))
    # the scale of plain bf16 noise: the bf16 model (and KV) against the fp32 one
    out["bf16 vs fp32 (model and KV)"] = _agreement(refs["fp32"], refs["bf16"])
    return out


def kv_fp8(args: argparse.Namespace, model_dir: str) -> int:
    """fp8 vs bf16 KV: photos that fit in one ``--kv-cache-memory``, hit rate over a
    working set ``--over`` x the bf16 pool, and quality of teacher-forced logits."""
    pool_path = checkpoint(args.pool_size, args.family)
    pool_model = load_model(pool_path, dtype=torch.bfloat16)
    shape = pool_model.decoder.shape
    context = shape.max_position_embeddings
    bpt = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, torch.bfloat16)
    memory = context * bpt  # the smallest budget that passes the pool check in bf16
    quick = args.scale != "full"
    out: dict[str, Any] = {"kv_cache_memory": memory, "pool_model": args.pool_size}
    # photo prompts are ~590 tokens: this many fill the fp8 pool (twice the bf16 one) and more
    imgs = list(workloads.photos(3 * context // 590 + 2).values())
    out["capacity"] = cap = capacity(pool_model, pool_path, memory, imgs)
    n = args.over * cap["bf16"]["images_resident"]
    many = list(workloads.photos(n).values())
    requests = (2 if quick else 3) * n
    out["hit_rate"] = hr = hit_rate(pool_model, pool_path, memory, many, requests, args.seed)
    positions = 400 if quick else args.positions
    out["quality"] = q = quality(model_dir, list(workloads.photos(8).values()), positions)
    out["load_avg"] = report.loadavg()
    md = (
        f"fp8 vs bf16 KV, --kv-cache-memory {memory / 2**20:.2f} MiB ({args.pool_size} model, "
        f"page 16, load {out['load_avg']})\n\n"
        + report.table(
            {k: {**cap[k], **{"hit": hr[k]["cache_hit_rate"]}} for k in ("bf16", "fp8")},
            "KV|bytes/token=kv_bytes_per_token|pool tokens=pool_tokens|photos resident="
            "images_resident|hit rate=hit:.3f",
        )
        + f"\nphotos resident fp8 / bf16: {cap['ratio']:.2f}x (goal >= 1.9); hit rate over "
        f"{hr['images']} photos ({args.over}x the bf16 pool), {hr['requests']} Zipf(1) "
        f"questions: fp8 {hr['fp8']['cache_hit_rate']:.3f} vs bf16 "
        f"{hr['bf16']['cache_hit_rate']:.3f} ({hr['ratio']:.2f}x)\n\n"
        + report.table(
            q,
            "logits|positions=positions|top-1 agreement=top1_agreement:.4f"
            "|mean KL (nats)=mean_kl:.2e|max KL=max_kl:.2e",
        )
    )
    return report.emit(args.out, "kv_fp8", out, md)
