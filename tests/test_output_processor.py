"""The output side of the API process (issue 41, part 2): ``DecodeStream`` detokenization,
updates that carry only what is new (``StreamUpdate.merged``), stop strings held back
once, the final-only mode of non-streamed answers and the submission's merged slots."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer

from api.metrics import Metrics
from api.openai_format import chat_stream
from api.submit import EngineClient
from mmserve.frontend.detokenizer import IncrementalDetokenizer
from mmserve.frontend.output import StreamUpdate
from mmserve.types import EngineRequest, GenerateResult, SamplingParams, TokenDelta, TokenLogprob
from tests.helpers import MODEL, TINY_FAMILIES, stream_chunks, user
from tests.live_server import app_client


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def tok(request, families):
    """Each family's tiny tokenizer (byte-level BPE; SentencePiece with byte fallback)."""
    return AutoTokenizer.from_pretrained(families[request.param].model_dir)


def _ids(tok) -> st.SearchStrategy[list[int]]:
    """Random ids, heavy on byte-fallback, special and multi-byte-character tokens."""
    vocab = tok.get_vocab()
    byte_ids = sorted(i for t, i in vocab.items() if t.startswith("<0x") and len(t) == 6)
    multibyte = sorted({i for s in ("北京", "🙂é", "Ωμ") for i in tok.encode(s)})
    pools = [
        st.integers(0, len(tok) - 1),
        st.sampled_from(sorted(tok.all_special_ids)),
        st.sampled_from(multibyte),
    ]
    if byte_ids:
        pools.append(st.sampled_from(byte_ids))
    return st.lists(st.one_of(pools), min_size=0, max_size=30)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_decode_stream_text_equals_one_shot_decode(tok, data) -> None:
    """Pieces join to ``tokenizer.decode`` of the ids after the context, whatever the
    push sizes; no piece before the end ends inside a character (U+FFFD)."""
    ctx = data.draw(_ids(tok).map(lambda ids: ids[:4]), label="context")
    ids = data.draw(_ids(tok), label="ids")
    step = data.draw(st.integers(1, 5), label="ids per push")
    dt = IncrementalDetokenizer(tok, context=ctx)
    assert isinstance(dt._stream, DecodeStream)  # the fast tokenizer's own decoder
    pieces = [dt.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    assert not any(p.endswith("\ufffd") for p in pieces)
    text = "".join(pieces) + dt.flush()
    whole = tok.decode(ctx + ids, skip_special_tokens=True)
    assert text == whole[len(tok.decode(ctx, skip_special_tokens=True)) :]
    # final-only: one decode of all the ids gives the same text
    assert IncrementalDetokenizer(tok, context=ctx).decode_whole(ids) == text
    # a tokenizer without a Rust backend: the same algorithm in Python, the same text
    py = IncrementalDetokenizer(_PythonOnly(tok), context=ctx)
    py_pieces = [py.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    assert "".join(py_pieces) + py.flush() == text


class _PythonOnly:
    """A tokenizer seen without its Rust backend (only ``decode`` and its vocabulary)."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.all_special_ids = tok.all_special_ids
        self.added_tokens_decoder = tok.added_tokens_decoder

    def get_vocab(self) -> dict[str, int]:
        return self.tok.get_vocab()

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


# ---- StreamUpdate.merged ------------------------------------------------------------------


def _result(text: str, ids: list[int], reason: str = "stop") -> GenerateResult:
    return GenerateResult("r", text, ids, reason, 1, 0, len(ids), 0, 0, 0.0, 0.0)


_LP = st.builds(TokenLogprob, st.integers(0, 99), st.floats(-20, 0), st.just(()))
_UPDATE = st.builds(
    StreamUpdate,
    st.text(max_size=5),
    st.lists(st.integers(0, 99), max_size=3).map(tuple),
    st.none() | st.lists(_LP, max_size=3).map(tuple),
    st.integers(0, 50),
    st.none() | st.builds(_result, st.text(max_size=3), st.just([])),
)


@settings(max_examples=200, deadline=None)
@given(ups=st.lists(_UPDATE, min_size=1, max_size=6))
def test_merged_concatenates_and_takes_the_later_state(ups: list[StreamUpdate]) -> None:
    m = functools.reduce(StreamUpdate.merged, ups)
    assert m.delta_text == "".join(u.delta_text for u in ups)
    assert m.delta_ids == sum((u.delta_ids for u in ups), ())
    if all(u.delta_logprobs is None for u in ups):
        assert m.delta_logprobs is None
    else:
        assert m.delta_logprobs == sum((u.delta_logprobs or () for u in ups), ())
    assert m.num_ids == ups[-1].num_ids and m.result is ups[-1].result
    # associative: a reader may merge in any grouping
    if len(ups) >= 3:
        a, b, c = ups[:3]
        assert a.merged(b).merged(c) == a.merged(b.merged(c))


# ---- final-only against streamed, on a real engine ----------------------------------------


def _run_both(eng, reqs: list[EngineRequest]) -> list[tuple[list[StreamUpdate], list]]:
    """Run ``reqs`` together, each delta fed to a streaming and to a final-only collector
    of the request: ``(streamed updates, final-only updates)`` per request."""
    out = []
    for msg in reqs:
        s, f = eng.collector(msg), eng.collector(msg, final_only=True)
        ups: list[StreamUpdate] = []
        fin: list[StreamUpdate] = []

        def on_update(d: TokenDelta, s=s, f=f, ups=ups, fin=fin, rid=msg.rid) -> None:
            if (u := s.add(d)) is not None:
                ups.append(u)
            if (v := f.add(d)) is not None:
                fin.append(v)
            assert f.stop_hit == s.stop_hit  # the stop is found at the same delta
            if s.stop_hit:
                s.stop_hit = f.stop_hit = False
                eng.stop_at_next_step(rid)

        eng.add_request(msg, on_update)
        out.append((ups, fin))
    while eng.has_work():
        eng.step()
    return out


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_final_only_result_equals_streamed_result(families, family: str) -> None:
    """Same seeded requests (sampled, logprobs, stop strings across token boundaries,
    ``min_tokens``): the final-only collector's one update is the merge of every streamed
    update, and their results agree; a stop string is applied once (the streamed text is
    the result's text, the ids end at the token completing it)."""
    eng = families[family].make_engine(max_total_tokens=4096)
    prompts = ["Describe the weather.", "Tell me a story.", "Count to ten."]

    def make(params: SamplingParams) -> list[EngineRequest]:
        return [
            eng.processor.make_request(messages=user(p), images=[], params=params, rid=f"{p}{i}")
            for i, p in enumerate(prompts)
        ]

    base = dict(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True, logprobs=2)
    free = [fin[0].result.text for _, fin in _run_both(eng, make(SamplingParams(**base)))]
    # stops cut from the middle of the answers: they straddle token boundaries
    stops = sorted({t[len(t) // 2 : len(t) // 2 + 3] for t in free if len(t) > 4})
    cases = [
        SamplingParams(**base),
        SamplingParams(**base, stop=stops),
        SamplingParams(**base, stop=stops, min_tokens=6),
    ]
    stopped = 0
    for params in cases:
        for ups, fin in _run_both(eng, make(params)):
            assert len(fin) == 1 and fin[0].result is not None
            merged = functools.reduce(StreamUpdate.merged, ups)
            res, one = merged.result, fin[0]
            assert (one.delta_text, one.delta_ids, one.delta_logprobs, one.num_ids) == (
                merged.delta_text,
                merged.delta_ids,
                merged.delta_logprobs,
                merged.num_ids,
            )
            for field in ("text", "output_ids", "finish_reason", "logprobs", "completion_tokens"):
                assert getattr(one.result, field) == getattr(res, field), field
            assert merged.delta_text == res.text and list(merged.delta_ids) == res.output_ids
            if params.stop and res.finish_reason == "stop":
                stopped += 1
                assert not any(s in res.text for s in params.stop)
    assert stopped >= 2  # the stop strings did end answers


def test_streamed_updates_carry_no_copies_of_the_text(families) -> None:
    """A count: the characters all updates of a streamed request carry add up to the
    answer once (each update holds its new text only), not a copy per token."""
    eng = families["llava"].make_engine(max_total_tokens=4096)
    params = SamplingParams(max_tokens=96, temperature=1.0, seed=3, ignore_eos=True)
    msg = eng.processor.make_request(messages=user("Hi"), images=[], params=params)
    ((ups, _),) = _run_both(eng, [msg])
    text = ups[-1].result.text
    assert len(ups) >= 90 and len(text) >= 90
    values = [getattr(u, f.name) for u in ups for f in dataclasses.fields(u)]
    carried = sum(len(v) for v in values if isinstance(v, str))
    assert carried == len(text)


# ---- the SSE writer and the submission ----------------------------------------------------


class _Replay:
    """An async engine stand-in: each request's updates come from a test-fed queue."""

    def __init__(self, eng) -> None:
        self.eng = eng
        self.queues: dict[str, asyncio.Queue] = {}
        self.made: list[tuple[str, bool]] = []

    async def stream(self, req: EngineRequest, final_only: bool = False):
        col = self.eng.collector(req, final_only)
        self.made.append((req.rid, final_only))
        q = self.queues.setdefault(req.rid, asyncio.Queue())
        while True:
            if (upd := col.add(await q.get())) is None:
                continue
            yield upd
            if upd.result is not None:
                return


def _deltas(tok, rid: str, text: str) -> list[TokenDelta]:
    ids = tok.encode(text, add_special_tokens=False)
    return [
        TokenDelta(rid, (t,), None, 0.0, finish_reason="length" if k == len(ids) - 1 else None)
        for k, t in enumerate(ids)
    ]


def test_chat_stream_sends_each_delta_text_as_it_is(families) -> None:
    """The SSE writer holds nothing back (the collector did): each update's
    ``delta_text`` is one chunk's content, in order, stop-string look-alikes included."""

    class Sub:
        reqs = [None]

        class client:  # the attribute chat_stream reads
            @staticmethod
            def failure(_result: GenerateResult) -> None:
                return None

        def __init__(self, ups: list[StreamUpdate]) -> None:
            self.ups = ups

        async def updates(self):
            for u in self.ups:
                yield 0, u

        def cancel(self) -> None:
            pass

    done = _result("abc", [1, 2, 3])
    ups = [StreamUpdate("a", (1,)), StreamUpdate("", (2,)), StreamUpdate("bc", (3,), result=done)]

    async def run() -> list[str]:
        return [e async for e in chat_stream(Sub(ups), "c", 0, MODEL, None, False)]

    events = asyncio.run(run())
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    contents = [c["choices"][0]["delta"].get("content") for c in chunks]
    assert contents == ["", "a", "bc", None]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_submission_merges_a_slow_readers_updates(families) -> None:
    """Updates that arrive while the reader is busy wait merged in one slot per request
    (no queue entry per token); a final-only submission yields one update per request."""
    eng = families["llava"].make_engine(max_total_tokens=4096)
    tok = eng.model.tokenizer
    texts = ["Hello there, how are you today?", "The weather is fine and warm."]

    async def run(final_only: bool) -> tuple[list[tuple[int, StreamUpdate]], list]:
        replay = _Replay(eng)
        client = EngineClient(replay, Metrics(), max_queued=100, retry_after=1)  # type: ignore[arg-type]
        params = SamplingParams(max_tokens=64, stop=["zzzz"])
        reqs = [EngineRequest((1, 2), (), params, rid=f"q{i}") for i in range(2)]
        sub = client.submit(reqs, final_only=final_only)
        for _ in range(3):
            await asyncio.sleep(0)  # the pumps start and wait on their queues
        for r, t in zip(reqs, texts, strict=True):
            for d in _deltas(tok, r.rid, t):
                replay.queues[r.rid].put_nowait(d)
        for _ in range(200):  # every delta is collected before the reader looks
            await asyncio.sleep(0)
        got = [x async for x in sub.updates()]
        return got, replay.made

    got, made = asyncio.run(run(False))
    assert [i for i, _ in got] == [0, 1]  # one merged update per request
    for (_, u), t in zip(got, texts, strict=True):
        assert u.delta_text == t == u.result.text
        assert list(u.delta_ids) == u.result.output_ids
    assert made == [("q0", False), ("q1", False)]
    got, made = asyncio.run(run(True))
    assert [i for i, _ in got] == [0, 1] and all(u.result is not None for _, u in got)
    assert [u.delta_text for _, u in got] == texts
    assert made == [("q0", True), ("q1", True)]


# ---- over HTTP ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(families):
    engine = families["llava-next"].make_engine(max_total_tokens=4096)
    with app_client(engine) as c:
        yield c


def test_streamed_and_plain_chat_agree_with_stop_strings(client) -> None:
    """Streamed and plain answers (plain: final-only collectors) of the same seeded
    request give the same text and finish reason per choice, with stop strings."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something long."}],
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 11,
        "n": 2,
    }
    free = client.post("/v1/chat/completions", json=body).json()
    text = free["choices"][0]["message"]["content"]
    body["stop"] = [text[len(text) // 2 : len(text) // 2 + 2], "\n\n\n"]
    plain = client.post("/v1/chat/completions", json=body).json()
    chunks = stream_chunks(client, body)
    for i in range(2):
        content = "".join(
            c["choices"][0]["delta"].get("content") or ""
            for c in chunks
            if c["choices"] and c["choices"][0]["index"] == i
        )
        finish = [
            c["choices"][0]["finish_reason"]
            for c in chunks
            if c["choices"] and c["choices"][0]["index"] == i and c["choices"][0]["finish_reason"]
        ]
        assert content == plain["choices"][i]["message"]["content"]
        assert finish == [plain["choices"][i]["finish_reason"]]
    assert plain["choices"][0]["finish_reason"] == "stop"
