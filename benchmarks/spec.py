"""``spec``: n-gram speculative decoding (``--speculative ngram``) on a prompt-copying
workload, on against off.

The workload is document QA whose answer quotes the document: a ~150-token passage, a
question asking for it verbatim, ``--tokens`` answer tokens (``ignore_eos``). A random
checkpoint never quotes its prompt, so two models are measured:

- **quoting**: the checkpoint edited by :func:`mmserve.testing.copying.quoting_model`
  (every layer's output projections zeroed, the LM head a bigram table of the passage):
  its greedy answer copies the passage, as a real model's quote would, and then cycles
  through a bigram loop of it (also text it has seen). Every layer still runs at full
  size, so a step costs what the random checkpoint's does;
- **rejected**: the same edit with the passage's bigrams reversed (its answer walks the
  passage backwards), so a 1-gram lookup finds a draft (the forward continuation) at
  nearly every step and the target rejects most of them (where the passage's bigram
  loops agree, some are kept): near the worst case, what a verify costs with little
  kept (its ``forced`` row also sets ``speculative_min_accepted`` 0, so the request's own
  switch never stops it);
- **random**: the unedited checkpoint, whose answer repeats nothing: what speculation
  costs when drafts are (nearly) never found or kept.

Per model and batch size ``B`` (``--batches``; ``B`` copies of the prompt decoded
together; the prompt's KV is cached by a warm-up round, so the rounds time decode):
``off``, ``on`` (the default switches: at ``B`` above ``speculative_max_batch`` it turns
itself off) and ``forced`` (``speculative_max_batch`` 64: always drafting, which measures
where the default threshold belongs). Configurations run interleaved in each round, in
rotated order; the figures are medians over ``--rounds`` rounds: tokens/s, the ratio to
off in the same round by wall time and by this process's CPU time (less sensitive to
other jobs on a shared machine), forward steps, accepted length (tokens per verify: 1 +
kept drafts) and the share of drafted tokens kept.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.in_process import model_dir as checkpoint
from benchmarks.report import emit, fmt, loadavg, md_table
from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
from mmserve.model.loader import load_model
from mmserve.testing.copying import quoting_model
from mmserve.types import SamplingParams

DOCUMENT = (
    "Invoice 2291 was issued on 14 March by Harbour Lane Supplies to the Riverside school "
    "district for forty-two replacement desks, sixteen whiteboards and the installation of "
    "new lighting in the east wing. Payment is due within thirty days of delivery; a late "
    "fee of two percent per month applies to any balance left unpaid after that date. "
    "Questions about this invoice should be sent to the accounts office, which answers "
    "within two working days and keeps a record of every payment received."
)
QUESTION = "What does the invoice say about payment and late fees? Quote the document."

OPTIONS = [
    (("--tokens",), dict(type=int, default=64, help="answer tokens per request")),
    (("--rounds",), dict(type=int, default=5, help="interleaved rounds")),
    (("--batches",), dict(default="1,2,4,8", help="decode batch sizes")),
    (("--k",), dict(type=int, default=4, help="--num-speculative-tokens")),
    (("--models",), dict(default="quoting,rejected,random")),
    (("--dtype",), dict(default="auto")),
    (("--device",), dict(default="cpu")),
]

CONFIGS: dict[str, dict[str, Any]] = {
    "off": {},
    "on": {"speculative": "ngram"},
    "forced": {"speculative": "ngram", "speculative_max_batch": 64},
}


def _messages() -> list[dict]:
    text = f"Document:\n{DOCUMENT}\n\nQuestion: {QUESTION}"
    return [{"role": "user", "content": [{"type": "text", "text": text}]}]


def _round(eng: Engine, batch: int, tokens: int) -> tuple[float, float, dict[str, int]]:
    """Wall and CPU seconds to answer ``batch`` copies of the prompt, and the engine
    counters it moved."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    reqs = [
        eng.processor.make_request(messages=_messages(), images=[], params=params)
        for _ in range(batch)
    ]
    s = eng.stats
    keys = ("decode_steps", "spec_verifies", "spec_drafted_tokens", "spec_accepted_tokens")
    before = {k: getattr(s, k) for k in keys}
    t0, c0 = time.perf_counter(), time.process_time()
    eng.generate(reqs)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    return dt, dc, {k: getattr(s, k) - before[k] for k in keys}


def run(args: argparse.Namespace, model_dir: str | None) -> int:
    """``spec``: speculation on a prompt-copying workload, on against off."""
    assert model_dir is not None
    dtype = EngineConfig(device=args.device, dtype=args.dtype).torch_dtype()
    loaded = load_model(model_dir, device=args.device, dtype=dtype)
    base = Engine(EngineConfig(model_path=model_dir, device=args.device), model=loaded)
    prompt = base.processor.make_request(messages=_messages(), images=[])
    passage = loaded.tokenizer.encode(DOCUMENT, add_special_tokens=False)
    start = prompt.input_ids[-1]
    del base, loaded
    edits = {"quoting": passage, "rejected": passage[::-1]}

    def model_for(name: str) -> Any:
        """A fresh load, edited in place (one copy of the weights in memory at a time)."""
        fresh = load_model(model_dir, device=args.device, dtype=dtype)
        if name == "random":
            return fresh
        return quoting_model(fresh, edits[name], start, copy_decoder=False)

    batches = [int(b) for b in args.batches.split(",")]
    results: dict[str, Any] = {
        "model": model_dir,
        "size": args.size,
        "prompt_tokens": len(prompt.input_ids),
        "passage_tokens": len(passage),
        "tokens": args.tokens,
        "k": args.k,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "device": args.device,
        "dtype": str(dtype).removeprefix("torch."),
        "loadavg_before": loadavg(),
        "rows": [],
    }
    rows = []
    # room for every batch's prompts and answers (engines are kept across batch sizes)
    pool = (len(prompt.input_ids) + args.tokens + 64) * max(batches) + 1024
    for name in args.models.split(","):
        model = model_for(name)
        configs = {c: dict(kw) for c, kw in CONFIGS.items()}
        if name == "rejected":  # the worst case: drafting never stops
            configs["forced"].update(speculative_min_accepted=0.0, ngram_min=1)
        engines = {
            c: Engine(
                EngineConfig(
                    model_path=model_dir,
                    device=args.device,
                    num_speculative_tokens=args.k,
                    max_total_tokens=pool,
                    **kw,
                ),
                model=model,
            )
            for c, kw in configs.items()
        }
        for batch in batches:
            for eng in engines.values():  # the same empty tree, then a warm-up round: the
                eng.flush_cache()  # prompt's KV cached, first-call costs paid
                _round(eng, batch, 4)
            secs: dict[str, list[float]] = {c: [] for c in engines}
            ratio: dict[str, list[float]] = {c: [] for c in engines}
            cpu_ratio: dict[str, list[float]] = {c: [] for c in engines}
            moved: dict[str, dict[str, int]] = {c: {} for c in engines}
            order = list(engines)
            for r in range(args.rounds):
                got, cpu = {}, {}
                for c in order[r % len(order) :] + order[: r % len(order)]:
                    got[c], cpu[c], counts = _round(engines[c], batch, args.tokens)
                    for k, v in counts.items():
                        moved[c][k] = moved[c].get(k, 0) + v
                for c in engines:
                    secs[c].append(got[c])
                    ratio[c].append(got["off"] / got[c])
                    cpu_ratio[c].append(cpu["off"] / cpu[c])
            for c in engines:
                m = moved[c]
                verifies = m["spec_verifies"]
                row = {
                    "model": name,
                    "batch": batch,
                    "config": c,
                    "tok_s": batch * args.tokens / statistics.median(secs[c]),
                    "speedup": statistics.median(ratio[c]),
                    "speedup_cpu": statistics.median(cpu_ratio[c]),
                    "steps_per_round": m["decode_steps"] / args.rounds,
                    "accepted_length": 1 + m["spec_accepted_tokens"] / verifies
                    if verifies
                    else None,
                    "kept_share": m["spec_accepted_tokens"] / m["spec_drafted_tokens"]
                    if m["spec_drafted_tokens"]
                    else None,
                }
                rows.append(row)
                print(row, flush=True)
        del engines, model  # before the next model's weights are loaded
        gc.collect()
    results["rows"] = rows
    results["loadavg_after"] = loadavg()
    table = md_table(
        "model | B | config | tok/s | vs off (wall) | vs off (CPU) | decode steps "
        "| accepted length | drafts kept",
        [
            [
                r["model"], r["batch"], r["config"], fmt(r["tok_s"]), fmt(r["speedup"]),
                fmt(r["speedup_cpu"]),
                fmt(r["steps_per_round"]), fmt(r["accepted_length"]), fmt(r["kept_share"]),
            ]
            for r in rows
        ],
    )  # fmt: skip
    md = (
        f"spec: {args.size} {results['dtype']} on {args.device} "
        f"({results['prompt_tokens']}-token prompt, "
        f"{results['passage_tokens']}-token passage), {args.tokens} tokens, k={args.k}, "
        f"{args.rounds} interleaved rounds, {results['threads']} thread(s), load "
        f"{results['loadavg_before']} -> {results['loadavg_after']}\n\n{table}"
    )
    return emit(args.out, "spec", results, md)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.spec``: the subcommand without the benchmark CLI's extras
    (httpx, matplotlib), as scripts/gpu_check.sh runs it on CUDA."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.spec", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--size", default="small")
    ap.add_argument("--family", default="llava")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    for flags, kw in OPTIONS:
        ap.add_argument(*flags, **kw)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return run(args, checkpoint(args.size, args.family, args.model))


if __name__ == "__main__":
    sys.exit(main())
