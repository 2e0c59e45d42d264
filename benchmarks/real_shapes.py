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
        reqs = [self.request(q, n) for q in questions]
        for r in reqs:
            self.engine.add_request(r)
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
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if model is None or not Path(model).is_dir():
        from mmserve.model.make_checkpoint import make_checkpoint

        model = str(make_checkpoint(model or "benchmarks/results/onevision-0.5b", "onevision-0.5b"))
    results = {}
    for dtype in args.dtypes.split(","):
        results[dtype] = _run_dtype(model, dtype, args.tokens, args.repeats, args.batch)
        print(f"{dtype}: {json.dumps(results[dtype])}", flush=True)
    table = _table(results)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "threads": torch.get_num_threads(),
                               "results": results, "table": table}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
