"""mmserve against transformers at real model shapes, side by side in one run.

``python -m benchmarks.real_shapes --model DIR`` (DIR from ``mmserve make-model DIR --size
onevision-0.5b``; built there when missing) measures, per dtype (bf16 and fp32), on one
380x300 photo:

- first question: vision tower + prefill to the first token (transformers'
  ``LlavaOnevisionForConditionalGeneration.generate`` vs a fresh mmserve engine);
- second question about the same photo: transformers recomputes everything, mmserve
  hits its prefix cache;
- decode ms/token at batch 1 (transformers: token timestamps from a ``generate``
  streamer; mmserve: ``Engine.step`` calls of a lone running request);
- mmserve with 8 concurrent answers: tokens/s against batch 1's.

Both run the same seeded weights and greedy decoding with ``ignore_eos`` lengths; each
figure is the median of ``--repeats`` runs, alternating systems, so load from other
processes on the machine hits both alike; decode is also given in CPU time
(``time.process_time``, meaningful with ``--threads 1``, the default), which other
processes sharing the cores do not inflate. Results: a markdown table on stdout and JSON in
``--out``.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import statistics
import time
from pathlib import Path

import torch
from PIL import Image

SAMPLES = Path(__file__).resolve().parent.parent / "samples" / "images"
QUESTIONS = [
    "What is in this photo?",
    "Describe the photo in detail.",
    "What colours do you see?",
    "Is there a person in the picture?",
    "Where could this have been taken?",
    "What is the mood of the scene?",
    "Name three objects in the photo.",
    "What time of day is it?",
    "Write a caption for it.",
]


def _photo() -> bytes:
    im = Image.open(SAMPLES / "astronaut.png").convert("RGB").resize((380, 300))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


class _Stamps:
    """A ``generate`` streamer that timestamps every ``put`` (prompt first, then tokens)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []

    def put(self, value: torch.Tensor) -> None:  # noqa: ARG002
        self.times.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def end(self) -> None:
        pass


class TransformersSide:
    """transformers' OneVision model on the checkpoint, one request at a time."""

    def __init__(self, model_dir: str, dtype: torch.dtype) -> None:
        from transformers import LlavaOnevisionForConditionalGeneration

        from mmserve.model.families.llava_onevision import load_onevision_processor

        self.model = LlavaOnevisionForConditionalGeneration.from_pretrained(
            model_dir, dtype=dtype
        ).eval()
        self.processor = load_onevision_processor(Path(model_dir))
        self.image = Image.open(io.BytesIO(_photo())).convert("RGB")

    def ask(self, question: str, new_tokens: int) -> tuple[float, list[float], list[float]]:
        """``(seconds to the first token, per-token decode seconds, the same in CPU time)``."""
        conv = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
        ]
        text = self.processor.apply_chat_template(conv, add_generation_prompt=True)
        t0 = time.perf_counter()
        inputs = self.processor(images=[self.image], text=text, return_tensors="pt")
        inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        stamps = _Stamps()
        with torch.inference_mode():
            self.model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                streamer=stamps,
            )
        tokens, cpu = stamps.times[1:], stamps.cpu[1:]  # the first put is the prompt
        gaps = [b - a for a, b in zip(tokens, tokens[1:], strict=False)]
        cpu_gaps = [b - a for a, b in zip(cpu, cpu[1:], strict=False)]
        return tokens[0] - t0, gaps, cpu_gaps

    def decode_batch(self, batch: int, new_tokens: int) -> tuple[list[float], list[float]]:
        """Per-step decode seconds (wall, CPU) of ``generate`` on ``batch`` copies of the
        first question's prompt (text + the photo).

        The prompt less its last token is prefilled once at batch 1 (kept between calls)
        and its cache repeated ``batch`` times; ``generate`` then runs the last prompt
        token and ``new_tokens`` greedy steps at batch ``batch``. The rows are identical,
        so left padding would add nothing, and the cache equals what a batched prefill
        computes: only the decode steps are timed, as ``batch`` separate prefills would
        cost ``batch`` x the first question without changing a step.
        """
        import copy

        if getattr(self, "_prefilled", None) is None:
            conv = [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[0]}],
                }
            ]
            text = self.processor.apply_chat_template(conv, add_generation_prompt=True)
            inputs = self.processor(images=[self.image], text=text, return_tensors="pt")
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
            head = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
            with torch.inference_mode():
                out = self.model(
                    input_ids=inputs["input_ids"][:, :-1],
                    attention_mask=inputs["attention_mask"][:, :-1],
                    use_cache=True,
                    **head,
                )
            self._prefilled = (inputs["input_ids"], inputs["attention_mask"], out.past_key_values)
        ids, mask, cache = self._prefilled
        cache = copy.deepcopy(cache)
        cache.batch_repeat_interleave(batch)
        stamps = _Stamps()
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids.repeat(batch, 1),
                attention_mask=mask.repeat(batch, 1),
                past_key_values=cache,
                max_new_tokens=new_tokens + 1,
                min_new_tokens=new_tokens + 1,
                do_sample=False,
                streamer=stamps,
            )
        # puts: the prompt, then each step's tokens; the first step ran the last prompt token
        t, c = stamps.times[1:], stamps.cpu[1:]
        return [b - a for a, b in zip(t, t[1:], strict=False)], [
            b - a for a, b in zip(c, c[1:], strict=False)
        ]


class MmserveSide:
    """A fresh mmserve engine per measurement series (the cache starts empty)."""

    def __init__(self, model_dir: str, dtype: str, model: object = None) -> None:
        from mmserve.config import EngineConfig
        from mmserve.engine.engine import Engine
        from mmserve.model.loader import load_model

        self.loaded = model or load_model(model_dir, dtype=getattr(torch, dtype))
        self.engine = Engine(
            EngineConfig(model_path=model_dir, dtype=dtype, max_total_tokens=32768),
            model=self.loaded,
        )
        self.image = self.engine.processor.prepare_image(_photo())

    def request(self, question: str, n: int):  # noqa: ANN201
        from mmserve.engine.sampling import SamplingParams

        msg = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        return self.engine.processor.make_request(
            messages=msg,
            images=[self.image],
            params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
        )

    def first_token(self, question: str) -> float:
        req = self.request(question, 1)
        t0 = time.perf_counter()
        self.engine.generate([req])
        return time.perf_counter() - t0

    def decode(self, questions: list[str], n: int) -> tuple[list[float], list[float], int]:
        """Step times (wall, CPU) after every request has its first token, and tokens
        produced."""
        reqs = [self.engine.request_state(self.request(q, n)) for q in questions]
        for r in reqs:  # the engine's own state objects, whose output_ids we watch
            self.engine.scheduler.add(r)
        while any(len(r.output_ids) < 1 for r in reqs):
            self.engine.step()
        before = sum(len(r.output_ids) for r in reqs)
        times, cpu = [], []
        while not all(r.finished for r in reqs):
            t0, c0 = time.perf_counter(), time.process_time()
            self.engine.step()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        return times, cpu, sum(len(r.output_ids) for r in reqs) - before


def _run_dtype(model_dir: str, dtype: str, tokens: int, repeats: int, batch: int) -> dict:
    tdt = getattr(torch, dtype)
    hf = TransformersSide(model_dir, tdt)
    ours = MmserveSide(model_dir, dtype)
    prompt_tokens = ours.request(QUESTIONS[0], 1).prompt_len
    keys = ["hf_first", "hf_second", "hf_decode", "hf_decode_cpu", "mm_first", "mm_second"]
    keys += ["mm_decode", "mm_decode_cpu", "mm_batch_tps", "mm_single_tps"]
    keys += ["mm_batch_tps_cpu", "mm_single_tps_cpu"]
    res: dict[str, list[float]] = {k: [] for k in keys}
    for rep in range(repeats):
        first, gaps, cpu_gaps = hf.ask(QUESTIONS[0], tokens)
        res["hf_first"].append(first)
        res["hf_decode"].append(statistics.median(gaps))
        res["hf_decode_cpu"].append(statistics.median(cpu_gaps))
        res["hf_second"].append(hf.ask(QUESTIONS[1], 2)[0])
        ours = MmserveSide(model_dir, dtype, model=ours.loaded)  # empty caches
        res["mm_first"].append(ours.first_token(QUESTIONS[0]))
        res["mm_second"].append(ours.first_token(QUESTIONS[1]))
        times, cpu, n = ours.decode([QUESTIONS[2 + rep % 3]], tokens)
        res["mm_decode"].append(statistics.median(times))
        res["mm_decode_cpu"].append(statistics.median(cpu))
        res["mm_single_tps"].append(n / sum(times))
        res["mm_single_tps_cpu"].append(n / sum(cpu))
        times, cpu, n = ours.decode([f"{q} (take {rep})" for q in QUESTIONS[:batch]], tokens)
        res["mm_batch_tps"].append(n / sum(times))
        res["mm_batch_tps_cpu"].append(n / sum(cpu))
    out = {k: statistics.median(v) for k, v in res.items()}
    out["prompt_tokens"] = prompt_tokens
    out["batch"] = batch
    del hf, ours
    gc.collect()
    return out


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> tuple[float, float]:
    """Memory read bandwidth in bytes/s, ``(per wall second, per CPU second)``: the best of
    ``repeats`` passes over a float32 tensor of ``nbytes`` (>= 1 GiB by default: far past
    the caches), on torch's current thread count, each pass either a ``sum`` or a
    matrix-vector product of the tensor as ``[n, 1024]`` (the kernel of a batch-1 decode
    step, whose prefetching reads faster than ``sum`` here). Both read each byte once with
    at most one multiply-add per 4 bytes, so they run at the memory's speed. The CPU form
    (``time.process_time``) is what other jobs sharing the cores do not lower, the one to
    set against CPU-time decode figures."""
    t = torch.ones(nbytes // 4 // 1024 * 1024, dtype=torch.float32)
    x = torch.ones(1024)
    best, best_cpu = float("inf"), float("inf")
    for i in range(2 * repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        t.sum() if i % 2 else t.view(-1, 1024) @ x
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, max(time.process_time() - c0, 1e-9))
    nbytes = t.numel() * 4
    del t
    return nbytes / best, nbytes / best_cpu


def decode_weight_bytes(decoder: torch.nn.Module) -> int:
    """Bytes of the weights one decode step reads: every decoder parameter once (a tied
    LM head is the embedding table, counted once), less the embedding table when it is not
    tied (a step reads only its batch's rows)."""
    total = sum(p.numel() * p.element_size() for p in decoder.parameters())
    emb = decoder.embed_tokens.weight
    if decoder.lm_head.weight is not emb:
        total -= emb.numel() * emb.element_size()
    return total


def decode_sweep(
    model_dir: str,
    dtype: str,
    batches: list[int],
    tokens: int,
    repeats: int,
    default_dtype_check: bool = False,
    bandwidth_bytes: int = 1 << 30,
) -> dict:
    """Decode ms/token at each batch size for mmserve and transformers, and the bound.

    mmserve: ``Engine.step`` times of ``b`` running requests (questions about the photo,
    its KV shared through the prefix cache) once each has its first token; transformers:
    :meth:`TransformersSide.decode_batch`. Per batch, the median step of each run, the
    median over ``repeats`` runs (systems alternate), wall and CPU seconds. The bound is
    :func:`decode_weight_bytes` / :func:`read_bandwidth` (of ``bandwidth_bytes``), both
    measured here.
    ``default_dtype_check``: also batch-1 decode of an engine made as ``mmserve serve``
    makes it without ``--dtype`` (``EngineConfig``'s default, its own model load),
    alternating with this dtype's engine (at least 2 pairs).

    Returns:
        a dict: ``bandwidth_gbs``, ``weight_bytes``, ``bound_ms`` (and ``bandwidth_cpu_gbs``,
        ``bound_cpu_ms`` per CPU second), and per batch ``b``
        ``{"mm": ms, "mm_cpu": ms, "hf": ms, "hf_cpu": ms}`` under ``"batches"``
        (milliseconds per step; a step yields ``b`` tokens); with the check, ``default``
        (the resolved default dtype, its ms and CPU ms per token, and this dtype's in the
        same pairs as ``explicit_ms``, ``explicit_cpu_ms``).
    """
    hf = TransformersSide(model_dir, getattr(torch, dtype))
    ours = MmserveSide(model_dir, dtype)
    res: dict[int, dict[str, list[float]]] = {
        b: {"mm": [], "mm_cpu": [], "hf": [], "hf_cpu": []} for b in batches
    }
    for rep in range(repeats):
        for b in batches:
            wall, cpu = hf.decode_batch(b, tokens)
            res[b]["hf"].append(statistics.median(wall))
            res[b]["hf_cpu"].append(statistics.median(cpu))
            qs = [f"{QUESTIONS[i % len(QUESTIONS)]} (take {rep}.{i})" for i in range(b)]
            wall, cpu, _ = ours.decode(qs, tokens + 1)
            res[b]["mm"].append(statistics.median(wall))
            res[b]["mm_cpu"].append(statistics.median(cpu))
    weight_bytes = decode_weight_bytes(ours.loaded.decoder)
    del hf
    gc.collect()
    bandwidth, bandwidth_cpu = read_bandwidth(bandwidth_bytes)
    out: dict = {
        "dtype": dtype,
        "tokens": tokens,
        "bandwidth_gbs": bandwidth / 1e9,
        "weight_bytes": weight_bytes,
        "bound_ms": weight_bytes / bandwidth * 1e3,
        "bandwidth_cpu_gbs": bandwidth_cpu / 1e9,
        "bound_cpu_ms": weight_bytes / bandwidth_cpu * 1e3,
        "batches": {
            b: {k: statistics.median(v) * 1e3 for k, v in r.items()} for b, r in res.items()
        },
    }
    if default_dtype_check:
        from mmserve.config import EngineConfig
        from mmserve.engine.engine import Engine

        default = Engine(EngineConfig(model_path=model_dir, max_total_tokens=32768))
        side = MmserveSide.__new__(MmserveSide)
        side.engine, side.loaded = default, None
        side.image = default.processor.prepare_image(_photo())
        pairs = []  # alternating, so both see the same load from other jobs
        for i in range(max(2, repeats)):
            d = side.decode([f"{QUESTIONS[2]} (default {i})"], tokens + 1)
            e = ours.decode([f"{QUESTIONS[2]} (explicit {i})"], tokens + 1)
            pairs.append((d, e))
        med = statistics.median
        out["default"] = {
            "dtype": str(default.config.torch_dtype()).removeprefix("torch."),
            "ms": med(med(d[0]) for d, _ in pairs) * 1e3,
            "cpu_ms": med(med(d[1]) for d, _ in pairs) * 1e3,
            "explicit_ms": med(med(e[0]) for _, e in pairs) * 1e3,
            "explicit_cpu_ms": med(med(e[1]) for _, e in pairs) * 1e3,
        }
    return out


def _decode_table(sweeps: list[dict]) -> str:
    rows = [
        "| dtype | batch | transformers ms/step (CPU) | mmserve ms/step (CPU) | mmserve / "
        "transformers (CPU) | mmserve ms/token | bound ms/step (CPU) | mmserve / bound (CPU) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for sw in sweeps:
        bound, bound_cpu = sw["bound_ms"], sw["bound_cpu_ms"]
        for b, r in sw["batches"].items():
            rows.append(
                f"| {sw['dtype']} | {b} | {r['hf']:.1f} ({r['hf_cpu']:.1f}) | "
                f"{r['mm']:.1f} ({r['mm_cpu']:.1f}) | {r['mm'] / r['hf']:.2f} "
                f"({r['mm_cpu'] / r['hf_cpu']:.2f}) | {r['mm'] / int(b):.1f} | {bound:.1f} "
                f"({bound_cpu:.1f}) | {r['mm'] / bound:.2f} ({r['mm_cpu'] / bound_cpu:.2f}) |"
            )
    for sw in sweeps:
        rows.append("")
        rows.append(
            f"{sw['dtype']}: read bandwidth {sw['bandwidth_gbs']:.1f} GB/s "
            f"({sw['bandwidth_cpu_gbs']:.1f} per CPU second), decode weights "
            f"{sw['weight_bytes'] / 1e9:.3f} GB -> bound {sw['bound_ms']:.1f} ms/step "
            f"({sw['bound_cpu_ms']:.1f} CPU)"
        )
        if "default" in sw:
            d = sw["default"]
            rows.append(
                f"default server dtype ({d['dtype']}): batch-1 decode {d['ms']:.1f} ms "
                f"(CPU {d['cpu_ms']:.1f}) vs --dtype {sw['dtype']} {d['explicit_ms']:.1f} (CPU "
                f"{d['explicit_cpu_ms']:.1f}), alternating: {d['ms'] / d['explicit_ms']:.2f}x "
                f"({d['cpu_ms'] / d['explicit_cpu_ms']:.2f}x CPU)"
            )
    return "\n".join(rows)


def _table(results: dict[str, dict]) -> str:
    rows = ["| | transformers | mmserve | mmserve / transformers |", "| --- | --- | --- | --- |"]
    for dtype, r in results.items():
        for label, hf, mm, unit in (
            ("first question (tower + prefill)", r["hf_first"], r["mm_first"], "s"),
            ("second question, same photo", r["hf_second"], r["mm_second"], "s"),
            ("decode, batch 1", r["hf_decode"] * 1e3, r["mm_decode"] * 1e3, "ms/token"),
            (
                "decode, batch 1, CPU time",
                r["hf_decode_cpu"] * 1e3,
                r["mm_decode_cpu"] * 1e3,
                "ms/token",
            ),
        ):
            rows.append(f"| {label}, {dtype} | {hf:.3g} {unit} | {mm:.3g} {unit} | {mm / hf:.2f} |")
        for suffix, what in (("", "tokens/s"), ("_cpu", "tokens per CPU second")):
            b, one = r["mm_batch_tps" + suffix], r["mm_single_tps" + suffix]
            rows.append(
                f"| {r['batch']} concurrent answers vs batch 1 ({what}), {dtype} | - | "
                f"{b:.1f} vs {one:.1f} | {b / one:.2f}x |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="real-shape checkpoint (default: build one)")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--tokens", type=int, default=16, help="answer length (tokens)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (0: torch's default); 1 keeps CPU-time figures meaningful",
    )
    p.add_argument("--out", default="benchmarks/results/real_shapes.json")
    p.add_argument(
        "--parts",
        default="compare,decode",
        help="compare (first/second question, batch-1 decode, concurrency) and/or decode "
        "(decode at --decode-batches against the weight-reading bound)",
    )
    p.add_argument("--decode-batches", default="1,4,8,16")
    p.add_argument("--decode-tokens", type=int, default=8, help="decode steps per run")
    p.add_argument(
        "--bandwidth-gb", type=float, default=1.0, help="tensor read to measure GB/s (GiB)"
    )
    p.add_argument(
        "--no-default-dtype",
        action="store_true",
        help="skip the default-dtype engine's batch-1 decode (the decode part's last row)",
    )
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if model is None or not Path(model).is_dir():
        from mmserve.testing.checkpoints import make_checkpoint

        model = str(make_checkpoint(model or "benchmarks/results/onevision-0.5b", "onevision-0.5b"))
    results: dict = {}
    sweeps: list[dict] = []
    table = ""
    if "compare" in parts:
        for dtype in args.dtypes.split(","):
            results[dtype] = _run_dtype(model, dtype, args.tokens, args.repeats, args.batch)
            print(f"{dtype}: {json.dumps(results[dtype])}", flush=True)
        table = _table(results)
    if "decode" in parts:
        batches = [int(b) for b in args.decode_batches.split(",")]
        for i, dtype in enumerate(args.dtypes.split(",")):
            check = i == 0 and not args.no_default_dtype
            sweeps.append(
                decode_sweep(
                    model,
                    dtype,
                    batches,
                    args.decode_tokens,
                    args.repeats,
                    check,
                    int(args.bandwidth_gb * (1 << 30)),
                )
            )
            print(f"decode {dtype}: {json.dumps(sweeps[-1])}", flush=True)
        table += ("\n\n" if table else "") + _decode_table(sweeps)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "threads": torch.get_num_threads(),
                               "results": results, "decode": sweeps,
                               "table": table}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
