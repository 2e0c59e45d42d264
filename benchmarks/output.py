"""``python -m benchmarks output``: the API process's CPU per output token, from token
deltas to server-sent events (what it measures: ``benchmarks/README.md``, "Output
processing").

Recorded token deltas of ``--requests`` concurrent chat completions x ``--tokens`` tokens
(one delta per request per engine step, as the engine sends them) go through what the
API process does with them: the submission (:class:`api.submit.Submission`), each
request's output collector (detokenization, stop strings, the result) and the answer's
formatting (``chat.completion.chunk`` events for a streamed request, the
``chat.completion`` object for a plain one). No engine runs and no socket is written: the
CPU time of the process divided by the tokens is the cost of the output side alone.

Each round runs in a fresh worker process per checkout (``--repo``: compare with another
checkout, e.g. ``git archive main``; the worker adapts to the older interfaces), checkouts
interleaved round by round; the table has the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: (name, streamed, stop strings) of the measured cases
CASES = (
    ("streamed", True, ()),
    ("plain", False, ()),
    ("streamed, stop", True, ("\n\n\n\n",)),
    ("plain, stop", False, ("\n\n\n\n",)),
)
#: text the recorded answers are cut from (English prose with markup: mixed tokens)
CORPUS = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def _recorded_ids(tokenizer, requests: int, tokens: int) -> list[list[int]]:
    """``requests`` answers of ``tokens`` ids each, consecutive slices of the corpus."""
    ids = tokenizer.encode(CORPUS.read_text(), add_special_tokens=False)
    while len(ids) < requests * 7 + tokens:
        ids = ids + ids
    return [ids[r * 7 : r * 7 + tokens] for r in range(requests)]


class _Replay:
    """Stands in for the async engine: replays recorded deltas, one per request per step,
    through each request's collector (as ``AsyncEngine.stream`` does: one queue per request)."""

    def __init__(self, tokenizer, answers: dict[str, list[int]]) -> None:
        from mmserve.frontend.output import OutputCollector

        self.tokenizer = tokenizer
        self.answers = answers
        self.queues: dict[str, asyncio.Queue] = {}
        self.has_final_only = "final_only" in inspect.signature(OutputCollector).parameters
        self.collector = OutputCollector

    async def stream(self, req, final_only: bool = False):
        kw = {"final_only": final_only} if self.has_final_only else {}
        col = self.collector(
            req.rid, self.tokenizer, req.params, len(req.input_ids), req.arrival, (), (0, 0), **kw
        )
        queue = self.queues[req.rid] = asyncio.Queue()
        while True:
            delta = await queue.get()
            upd = col.add(delta)
            if upd is None:
                continue
            yield upd
            if upd.result is not None:
                return

    async def run(self) -> None:
        """Send every request's deltas, one step (a delta per request) at a time."""
        from mmserve.types import TokenDelta

        while len(self.queues) < len(self.answers):
            await asyncio.sleep(0)
        steps = max(len(a) for a in self.answers.values())
        for t in range(steps):
            now = time.perf_counter()
            for rid, ids in self.answers.items():
                last = t == len(ids) - 1
                self.queues[rid].put_nowait(
                    TokenDelta(rid, (ids[t],), None, now, finish_reason="length" if last else None)
                )
            await asyncio.sleep(0)


_TOKENIZERS: dict = {}


async def _one_round(model_dir: str, requests: int, tokens: int, streamed: bool, stop) -> dict:
    from transformers import AutoTokenizer

    from api.metrics import Metrics
    from api.openai_format import chat_completion, chat_stream
    from api.submit import EngineClient
    from mmserve.types import EngineRequest, SamplingParams

    tokenizer = _TOKENIZERS.get(model_dir) or AutoTokenizer.from_pretrained(model_dir)
    _TOKENIZERS[model_dir] = tokenizer
    answers = _recorded_ids(tokenizer, requests, tokens)
    params = SamplingParams(max_tokens=tokens, stop=list(stop), ignore_eos=True)
    reqs = [EngineRequest((1, 2, 3), (), params, rid=f"r{i}") for i in range(requests)]
    replay = _Replay(tokenizer, {r.rid: a for r, a in zip(reqs, answers, strict=True)})
    client = EngineClient(replay, Metrics(), max_queued=10**6, retry_after=1)  # type: ignore[arg-type]
    takes_final = "final_only" in inspect.signature(client.submit).parameters
    holdback = "holdback" in inspect.signature(chat_stream).parameters
    chars = 0

    async def one(req) -> None:
        nonlocal chars
        kw = {"final_only": not streamed} if takes_final else {}
        sub = client.submit([req], **kw)
        if streamed:
            extra = (max((len(s) for s in stop), default=1) - 1,) if holdback else ()
            async for event in chat_stream(sub, "chatcmpl-x", 0, "m", None, True, *extra):
                chars += len(event)
        else:
            results = await sub.answers()
            chars += len(json.dumps(chat_completion("chatcmpl-x", 0, "m", results, None)))

    t0, w0 = time.process_time(), time.perf_counter()
    await asyncio.gather(replay.run(), *(one(r) for r in reqs))
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    n = requests * tokens
    return {"us_per_token": cpu / n * 1e6, "wall_us_per_token": wall / n * 1e6, "chars": chars}


def worker(argv: list[str]) -> None:
    """One round in this process (``--worker``): prints its JSON line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--tokens", type=int)
    a = ap.parse_args(argv)
    out = {}
    for case, streamed, stop in CASES:
        out[case] = asyncio.run(_one_round(a.model_dir, a.requests, a.tokens, streamed, stop))
    print(json.dumps(out))


def output(args: argparse.Namespace, model_dir: str) -> int:
    """API-process CPU per output token (collectors, submission, SSE or JSON answer) over
    recorded deltas, this checkout against ``--repo`` checkouts, interleaved rounds."""
    from benchmarks import report

    here = str(Path(__file__).resolve().parent.parent)
    repos = [("this checkout", here)] + [(f"--repo {r}", str(r)) for r in args.repo or ()]
    rounds = {"ci": 1, "quick": 3, "full": args.rounds}[args.scale]
    scale = {"ci": (16, 32), "quick": (128, 128), "full": (args.requests, args.tokens)}
    requests, tokens = scale[args.scale]
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for name, repo in repos:  # every case in one worker per checkout and round
            env = {**os.environ, "PYTHONPATH": repo}
            cmd = [sys.executable, __file__, "--worker", str(model_dir)]
            cmd += ["--requests", str(requests), "--tokens", str(tokens)]
            out = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr, file=sys.stderr)
                return 1
            got = json.loads(out.stdout.strip().splitlines()[-1])
            for case, *_ in CASES:
                samples.setdefault((name, case), []).append(got[case]["us_per_token"])
    rows = []
    for name, _ in repos:
        row: dict = {"checkout": name}
        for case, *_ in CASES:
            row[case] = round(statistics.median(samples[(name, case)]), 1)
        rows.append(row)
    meta = {
        "requests": requests,
        "tokens": tokens,
        "rounds": rounds,
        "load": report.loadavg(),
        "unit": "API-process CPU us per output token (median of rounds)",
    }
    head = ["checkout"] + [c for c, *_ in CASES]
    md = (
        f"{meta['unit']}; {requests} requests x {tokens} tokens, {rounds} rounds, "
        f"load {report.loadavg()}\n\n" + report.md_table(head, [list(r.values()) for r in rows])
    )
    return report.emit(args.out, "output", {"meta": meta, "rows": rows}, md)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.path.insert(0, os.environ.get("PYTHONPATH", ""))
        worker(sys.argv[2:])
