"""Tensor parallelism on CPU, for the record: decode tokens/s and weights per rank.

``python -m benchmarks.tensor_parallel [--size tiny|small] [--family ...] [--tp 2]``
runs the same batch of text prompts greedily on ``--tp 1`` with ``--threads`` torch
threads, on ``--tp 1`` with ``threads / N`` threads (a busy machine can make two
OpenMP threads much slower than one) and on ``--tp N`` with ``threads / N`` threads
per rank (gloo on 127.0.0.1),
one after the other in this process, checks that both give the same tokens, and
prints a JSON line: tokens/s of each, their ratio, and the decoder weight bytes of
every rank against the whole decoder. On CPU, tensor parallelism is for testing: no
target is set (two small processes over gloo pay a round trip per all-reduce).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mmserve.config import EngineConfig
from mmserve.engine.engine import Engine
from mmserve.engine.request import SamplingParams
from mmserve.model.make_checkpoint import FAMILY_NAMES, ensure_model


def _bytes(params) -> int:  # noqa: ANN001
    seen, total = set(), 0
    for p in params:
        key = (p.untyped_storage().data_ptr(), p.storage_offset())
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


def _run(model_dir: str, tp: int, threads: int, batch: int, tokens: int) -> tuple:
    torch.set_num_threads(threads)
    eng = Engine(EngineConfig(model_path=model_dir, tp=tp, max_total_tokens=8192))
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        mk = eng.processor.make_request
        eng.generate([mk(prompt="warm up", params=SamplingParams(max_tokens=2))])
        reqs = [
            mk(prompt=f"Story number {k}: once upon a time", params=params) for k in range(batch)
        ]
        t0 = time.perf_counter()
        res = eng.generate(reqs)
        secs = time.perf_counter() - t0
        dec = eng.model.decoder
        ranks = [_bytes(dec.parameters())]
        ranks += list(getattr(getattr(dec, "group", None), "worker_bytes", []))
        return [r.output_ids for r in res], sum(len(r.output_ids) for r in res) / secs, ranks
    finally:
        eng.close()


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison; prints and returns the figures."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--family", default="llava", choices=FAMILY_NAMES)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="threads of --tp 1 (split over ranks)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    a = p.parse_args(argv)
    model_dir = str(ensure_model(a.size, family=a.family))
    per_rank = max(1, a.threads // a.tp)
    ids1, tps1, bytes1 = _run(model_dir, 1, a.threads, a.batch, a.tokens)
    _, tps1_few, _ = _run(model_dir, 1, per_rank, a.batch, a.tokens)
    idsn, tpsn, bytesn = _run(model_dir, a.tp, per_rank, a.batch, a.tokens)
    out = {
        "family": a.family,
        "size": a.size,
        "tp": a.tp,
        "same_tokens": ids1 == idsn,
        "tokens_per_s_tp1": round(tps1, 1),
        f"tokens_per_s_tp1_{per_rank}_threads": round(tps1_few, 1),
        f"tokens_per_s_tp{a.tp}": round(tpsn, 1),
        "ratio": round(tpsn / tps1, 3),
        "decoder_bytes_tp1": bytes1[0],
        "decoder_bytes_per_rank": bytesn,
        "rank_fraction": [round(b / bytes1[0], 3) for b in bytesn],
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
