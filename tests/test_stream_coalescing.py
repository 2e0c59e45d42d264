"""The streamed output path under load (issue 41): a reader that is behind gets one
merged update per request (fewer, larger ``chat.completion.chunk`` events, every token's
logprobs entry still there, in order), a submission reads its requests' slots without a
task per request and wakes once per engine step, and the engine process's output pipe is
read as far as a message has arrived."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import pickle
import struct
import threading
import time

import pytest

from api.metrics import Metrics
from api.openai_format import TokenText, chat_events
from api.submit import EngineClient
from mmserve.config import EngineConfig
from mmserve.frontend.async_engine import AsyncEngine
from mmserve.frontend.engine_client import EngineProcessClient
from mmserve.types import SamplingParams
from tests.helpers import MODEL, user

try:  # the loop uvicorn picks when it is installed ("auto")
    import uvloop

    LOOPS = [asyncio.new_event_loop, uvloop.new_event_loop]
except ImportError:  # pragma: no cover - then only asyncio's
    LOOPS = [asyncio.new_event_loop]


@pytest.fixture(scope="module")
def aengine(families):
    eng = families["llava"].make_engine(max_total_tokens=4096)
    aeng = AsyncEngine(eng)
    aeng.start()
    yield aeng
    aeng.stop()


def _requests(aengine: AsyncEngine, n: int, tokens: int, logprobs: int | None = None):
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    proc = aengine.engine.processor
    return [
        proc.make_request(messages=user(f"Question {i}: say more."), images=[], params=params)
        for i in range(n)
    ]


def _events(strings: list[str]) -> list[str]:
    """The SSE ``data:`` payloads of the strings a stream wrote (each string: one send)."""
    out = []
    for s in strings:
        assert s.endswith("\n\n"), s[-40:]
        out += [e[6:] for e in s.split("\n\n") if e]
    return out


def test_slow_reader_gets_fewer_larger_events(aengine) -> None:
    """A reader that looks only after every choice has finished gets each choice's whole
    answer as one content chunk: the text equals the result's, the logprobs entries
    equal the completion tokens, in order; it is written in three sends (the roles, the
    answers, usage and ``[DONE]``). A reader that keeps up gets the same text."""
    tokens = 24
    tok = aengine.engine.model.tokenizer
    client = EngineClient(aengine, Metrics(), max_queued=100, retry_after=1)  # type: ignore[arg-type]

    async def run(slow: bool) -> tuple[list[str], list]:
        sub = client.submit(_requests(aengine, 2, tokens, logprobs=1))
        if slow:
            for _ in range(3000):
                if all(r is not None for r in sub.results):
                    break
                await asyncio.sleep(0.01)
            assert all(r is not None for r in sub.results)
        strings = [s async for s in chat_events(sub, "c", 0, MODEL, TokenText(tok), True)]
        return strings, list(sub.results)

    slow, results = asyncio.run(run(True))
    assert len(slow) == 3
    events = _events(slow)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 2 * tokens
    content = [c for c in chunks[:-1] if c["choices"][0]["delta"].get("content")]
    assert sorted(c["choices"][0]["index"] for c in content) == [0, 1]  # one chunk each
    for c in content:
        choice = c["choices"][0]
        res = results[choice["index"]]
        assert choice["delta"]["content"] == res.text
        lps = choice["logprobs"]["content"]
        assert len(lps) == tokens == res.completion_tokens
        assert [e["logprob"] for e in lps] == [lp.logprob for lp in res.logprobs]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish.count("length") == 2

    fast, fast_results = asyncio.run(run(False))
    texts = ["", ""]
    n_lps = [0, 0]
    for e in _events(fast)[:-1]:
        c = json.loads(e)
        if c["choices"]:
            ch = c["choices"][0]
            texts[ch["index"]] += ch["delta"].get("content") or ""
            n_lps[ch["index"]] += len((ch["logprobs"] or {}).get("content") or [])
    assert texts == [r.text for r in fast_results] == [r.text for r in results]
    assert n_lps == [tokens, tokens]
    assert len(_events(fast)) >= len(events)


def test_submission_reads_slots_without_a_task_per_request(aengine) -> None:
    """Submitting starts no task per request (the engine's output path tells the
    submission which slots filled), and the reader takes all that one engine step made
    at once: a batch holds several requests' updates."""
    client = EngineClient(aengine, Metrics(), max_queued=100, retry_after=1)  # type: ignore[arg-type]
    n, tokens = 6, 12

    async def run() -> tuple[int, list[list[int]], list]:
        sub = client.submit(_requests(aengine, n, tokens))
        tasks = len(asyncio.all_tasks())
        batches = [[i for i, _ in b] async for b in sub.batches()]
        return tasks, batches, sub.results

    tasks, batches, results = asyncio.run(run())
    assert tasks == 1  # this coroutine's own
    assert all(r is not None and r.completion_tokens == tokens for r in results)
    assert all(len(set(b)) == len(b) for b in batches)  # one merged update per request
    updates = sum(len(b) for b in batches)
    assert updates >= 2 * len(batches), batches  # each wake-up took several requests'
    assert client.queued == 0 and client.online == 0


@pytest.mark.parametrize("new_loop", LOOPS)
def test_engine_pipe_message_read_as_it_arrives(new_loop) -> None:
    """A step message that arrives in pieces (larger than the pipe, its writer paused
    midway) is read as far as it has come, without blocking the event loop, and handled
    whole once complete; the engine is not taken for dead."""
    client = EngineProcessClient(EngineConfig(model_path="unused"))
    rx, tx = multiprocessing.Pipe(duplex=False)
    client._rx, client._ready = rx, True
    value = "x" * 300_000
    payload = pickle.dumps([("reply", 7, True, value)])
    frame = struct.pack("!i", len(payload)) + payload

    def write() -> None:
        os.write(tx.fileno(), frame[:200_000])  # blocks until the reader takes some
        time.sleep(0.5)
        os.write(tx.fileno(), frame[200_000:])

    async def main() -> tuple[str, int]:
        client.attach()
        fut = asyncio.get_running_loop().create_future()
        client._calls[7] = fut
        writer = threading.Thread(target=write)
        writer.start()
        ticks = 0
        while not fut.done():
            await asyncio.sleep(0.02)
            ticks += 1
        writer.join()
        return fut.result(), ticks

    loop = new_loop()
    try:
        got, ticks = loop.run_until_complete(asyncio.wait_for(main(), 20))
    finally:
        loop.close()
        rx.close()
        tx.close()
    assert got == value
    assert ticks >= 3  # the loop ran while the message's second half was on its way
    assert client.deaths == 0 and client.unavailable() is None


def test_one_requests_failing_output_leaves_the_steps_others_alone() -> None:
    """A step's deltas go to every slot even when taking one raises (its listener's
    metrics, detokenizing): that request ends with the error, the others get theirs,
    and a still-running one stays abortable (``engine_done`` false)."""
    from types import SimpleNamespace

    from mmserve.frontend.async_engine import AsyncEngine, Slot
    from mmserve.types import TokenDelta

    def boom() -> None:
        raise RuntimeError("listener failed")

    bad, good = Slot(None), Slot(None)
    bad.listener = boom
    fake = SimpleNamespace(_slots={"a": bad, "b": good})
    deltas = [TokenDelta("a", (5,), None, 0.0), TokenDelta("b", (6,), None, 0.0)]
    AsyncEngine._dispatch(fake, deltas)  # type: ignore[arg-type]
    assert [d.token_ids for d in good._deltas] == [(6,)]
    assert bad.engine_done is False
    fin = TokenDelta("b", (7,), None, 0.0, finish_reason="length")
    AsyncEngine._dispatch(fake, [TokenDelta("a", (8,), None, 0.0, finish_reason="length"), fin])
    assert bad.engine_done is True and good.engine_done is True
