"""Chat completions in the OpenAI shape: logprobs, n, seeds, stop strings, streaming chunks."""

from __future__ import annotations

import math

import pytest

from tests.helpers import MODEL, ChatDefaults
from tests.live_server import app_client


@pytest.fixture(scope="module")
def client(make_engine):
    engine = make_engine(max_total_tokens=8192)
    with app_client(engine) as c:
        c.engine = engine
        yield c


STORY = ChatDefaults("Tell me a story.", max_tokens=6)
body, complete, stream = STORY.body, STORY.complete, STORY.stream


def streamed_text(chunks: list[dict], index: int = 0) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in chunks
        if c["choices"] and c["choices"][0]["index"] == index
    )


def test_logprobs_non_streamed(client) -> None:
    out = complete(client, logprobs=True, top_logprobs=3)
    choice = out["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == 6
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        # greedy: the chosen token is the most likely one
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
        raw = bytes(entry["bytes"])
        try:  # whole characters: the token is their text; else OpenAI's "bytes:\xNN" form
            assert entry["token"] == raw.decode()
        except UnicodeDecodeError:
            assert entry["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        assert sum(math.exp(t["logprob"]) for t in entry["top_logprobs"]) <= 1 + 1e-6
    # the raw bytes join to the text (which shows a stray byte at the end as U+FFFD)
    joined = b"".join(bytes(e["bytes"]) for e in content)
    assert joined.decode(errors="replace") == choice["message"]["content"]
    assert complete(client)["choices"][0]["logprobs"] is None
    plain = complete(client, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert all(e["top_logprobs"] == [] for e in plain)


def test_logprobs_streamed_equal_non_streamed(client) -> None:
    ref = complete(client, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    chunks = stream(client, logprobs=True, top_logprobs=2)
    got = [
        e
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert got == ref


def test_n_choices_and_seeds(client) -> None:
    out = complete(client, n=3, temperature=1.0, seed=11)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    singles = [
        complete(client, temperature=1.0, seed=s)["choices"][0]["message"]["content"]
        for s in (11, 12, 13)
    ]
    assert [c["message"]["content"] for c in out["choices"]] == singles
    assert out["usage"]["completion_tokens"] == 18
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 18
    greedy = complete(client, n=2)
    a, b = (c["message"]["content"] for c in greedy["choices"])
    assert a == b


def test_n_choices_streamed(client) -> None:
    ref = complete(client, n=2, temperature=1.0, seed=5)
    chunks = stream(client, n=2, temperature=1.0, seed=5, stream_options={"include_usage": True})
    for i in range(2):
        assert streamed_text(chunks, i) == ref["choices"][i]["message"]["content"]
        finals = [
            c
            for c in chunks
            if c["choices"] and c["choices"][0]["index"] == i and c["choices"][0]["finish_reason"]
        ]
        assert [f["choices"][0]["finish_reason"] for f in finals] == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_stream_chunk_shape(client) -> None:
    plain = complete(client)  # caches the prompt: the stream below reuses all but its last token
    chunks = stream(client, stream_options={"include_usage": True})
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    usage = chunks[-1]["usage"]
    prompt = plain["usage"]["prompt_tokens"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt, 6)
    assert usage["prompt_tokens_details"]["cached_tokens"] == prompt - 1
    assert usage["total_tokens"] == prompt + 6
    no_usage = stream(client)
    assert all("usage" not in c for c in no_usage)
    assert streamed_text(no_usage) == plain["choices"][0]["message"]["content"]


def test_stop_string_never_leaks_into_the_stream(client) -> None:
    full = complete(client, max_tokens=12)["choices"][0]["message"]["content"]
    assert len(full) > 6
    stop = full[3:6]
    cut = complete(client, max_tokens=12, stop=[stop])["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["message"]["content"] == full[: full.find(stop)]
    chunks = stream(client, max_tokens=12, stop=stop)
    assert streamed_text(chunks) == cut["message"]["content"]
    assert not any(stop in (c["choices"][0]["delta"].get("content") or "") for c in chunks[1:])


def test_optional_model_developer_role_and_default_length(client) -> None:
    msgs = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Again"},
    ]
    r = client.post(
        "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL


def test_default_max_tokens_is_capped_by_what_is_left(make_engine) -> None:
    engine = make_engine(max_total_tokens=1024)  # the pool, not the context, binds here
    with app_client(engine) as c:
        long = "word " * 470  # about 940 tokens
        r = c.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": long}],
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        assert 900 < u["prompt_tokens"] < 1000
        # no max_tokens: the default (256) cut to what the pool leaves, used to the last token
        assert u["prompt_tokens"] + u["completion_tokens"] == 1024
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": long * 2}]},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "KV pool holds 1024 tokens" in r.json()["error"]["message"]


def test_models_routes(client) -> None:
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL]
    assert data[0]["max_model_len"] == client.engine.max_context
    # the tiny checkpoint is make-model's: its card says its answers are noise
    assert data[0]["random_weights"] is True and "random" in data[0]["note"]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert client.get("/v1/models/gpt-4").json()["error"]["code"] == "model_not_found"


def stop_oracle(tokenizer, ids: list[int], stops: list[str]) -> tuple[str, str]:
    """Brute force: decode growing prefixes; at the first that holds any stop, cut at the
    earliest occurrence of any of them."""
    text = ""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)], "stop"
    return text, "length"


def test_earliest_stop_wins_whatever_the_list_order(client, make_engine) -> None:
    from mmserve.types import SamplingParams

    tok = client.engine.model.tokenizer
    ref = complete(client, max_tokens=16)["choices"][0]
    offline = make_engine()
    msgs = body()["messages"]
    req = offline.processor.make_request(messages=msgs, params=SamplingParams(max_tokens=16))
    ids = offline.generate([req])[0].output_ids
    full = ref["message"]["content"]
    assert len(full) > 10
    inner, outer = full[6:9], full[4:9]  # "END" inside "THE END": both complete together
    kinds = [
        [inner, outer],  # a stop that is a suffix of another
        [full[5:8], full[4:7]],  # overlapping stops
        [full[8:10], full[2:10]],  # one completes on the same token as another
        [full[7:12], full[3:5], "never-there"],
        [full[9:10], full[9:10] + "x"],
    ]
    for stops in kinds:
        want_text, want_reason = stop_oracle(tok, ids, stops)
        assert want_text != full
        for order in (stops, stops[::-1]):
            got = complete(client, max_tokens=16, stop=order)["choices"][0]
            assert (got["message"]["content"], got["finish_reason"]) == (want_text, want_reason)
            assert not any(s in got["message"]["content"] for s in stops)
            chunks = stream(client, max_tokens=16, stop=order)
            assert streamed_text(chunks) == want_text
    # with n > 1, every choice is cut the same way (greedy: identical choices)
    out = complete(client, max_tokens=16, stop=[inner, outer], n=3)
    want = stop_oracle(tok, ids, [inner, outer])[0]
    assert [c["message"]["content"] for c in out["choices"]] == [want] * 3
    chunks = stream(client, max_tokens=16, stop=[outer, inner], n=2)
    assert [streamed_text(chunks, i) for i in range(2)] == [want] * 2


def test_first_stop_is_the_earliest_occurrence() -> None:
    from hypothesis import given
    from hypothesis import strategies as st

    from mmserve.frontend.detokenizer import first_stop

    @given(
        st.text("ab ", max_size=12), st.lists(st.text("ab ", min_size=1, max_size=4), max_size=4)
    )
    def check(text: str, stops: list[str]) -> None:
        brute = [i for i in range(len(text)) if any(text.startswith(s, i) for s in stops)]
        assert first_stop(text, stops) == (brute[0] if brute else None)
        assert first_stop(text, stops[::-1]) == first_stop(text, stops)

    check()
