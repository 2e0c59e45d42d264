"""``logprobs.content[].bytes`` over HTTP: each token's raw bytes, joining to the content
(CJK and emoji split into byte tokens), streamed equal to plain, for every family; no
end-of-sequence entry that the grammar forced."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from api.app import ServerSettings, create_app
from tests.helpers import TINY_FAMILIES, stream_chunks

MODEL = "m"
TEXT = "\u5317\u4eac\u5728\u7ebf \U0001f600 ok"  # 北京在线 😀 ok
REPLACEMENT = list("\ufffd".encode())


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def client(request, families):
    """A server on each family's tiny checkpoint (llava: byte-level BPE; next:
    SentencePiece with byte fallback; onevision: Qwen2-style byte-level BPE)."""
    family = families[request.param]
    engine = family.make_engine(max_total_tokens=8192)
    with TestClient(create_app(engine, ServerSettings(served_model_name=MODEL))) as c:
        c.tok = AutoTokenizer.from_pretrained(family.model_dir)
        c.eos = engine.model.eos_token_ids
        yield c
    engine.check_accounting()


def body(**kw) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say it."}],
        "max_tokens": 40,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        **kw,
    }


def plain(client, **kw) -> dict:
    r = client.post("/v1/chat/completions", json=body(**kw))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def streamed(client, **kw) -> tuple[str, list[dict], str]:
    """(content, logprob entries, finish reason) of a streamed answer."""
    choices = [c["choices"][0] for c in stream_chunks(client, body(**kw))]
    text = "".join(c["delta"].get("content") or "" for c in choices)
    entries = [e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]
    return text, entries, choices[-1]["finish_reason"]


def joined(entries: list[dict]) -> bytes:
    return b"".join(bytes(e["bytes"]) for e in entries)


def assert_same_entries(got: list[dict], want: list[dict]) -> None:
    """Equal tokens and bytes (the top alternatives' too), logprobs within 1e-4: a prompt
    read from the cache and one prefilled afresh sum in another order (~1e-6 apart)."""

    def tokens(es: list[dict]) -> list:
        return [
            (e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]])
            for e in es
        ]

    def logprobs(es: list[dict]) -> list[float]:
        return [x["logprob"] for e in es for x in (e, *e["top_logprobs"])]

    assert tokens(got) == tokens(want)
    assert logprobs(got) == pytest.approx(logprobs(want), abs=1e-4)


def check_token_fields(entry: dict) -> None:
    """``token`` is the bytes' text when they are whole characters, else the
    ``bytes:\\xNN`` form; a U+FFFD never stands in for a byte."""
    for e in [entry, *entry["top_logprobs"]]:
        raw = bytes(e["bytes"])
        assert bytes(REPLACEMENT) not in raw
        try:
            assert e["token"] == raw.decode() or (raw == b"" and e["token"])
        except UnicodeDecodeError:
            assert e["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_forced_cjk_and_emoji_bytes_join_to_the_content(client) -> None:
    for kw in ({"guided_regex": TEXT}, {"guided_choice": [TEXT]}):
        choice = plain(client, **kw)
        content = choice["message"]["content"]
        assert content == TEXT and choice["finish_reason"] == "stop"
        entries = choice["logprobs"]["content"]
        assert joined(entries) == TEXT.encode()
        assert any(not e["token"] or e["token"].startswith("bytes:") for e in entries)
        for e in entries:
            check_token_fields(e)
        # the end-of-sequence token the grammar forced is not an answer token
        eos_texts = {client.tok.convert_ids_to_tokens(i) for i in client.eos}
        assert not {e["token"] for e in entries} & eos_texts
        text, s_entries, finish = streamed(client, **kw)
        assert (text, finish) == (content, "stop")
        assert_same_entries(s_entries, entries)


def test_biased_byte_tokens_keep_their_own_bytes(client) -> None:
    # logit_bias alone (no grammar) makes the model emit the pieces of TEXT in any order:
    # partial characters, often invalid UTF-8; each entry still has its own bytes
    ids = set(client.tok.encode(TEXT, add_special_tokens=False)) - set(client.tok.all_special_ids)
    bias = {str(i): 100 for i in ids}
    choice = plain(client, logit_bias=bias, max_tokens=12)
    entries = choice["logprobs"]["content"]
    assert len(entries) == 12 and choice["finish_reason"] == "length"
    for e in entries:
        check_token_fields(e)
        assert bytes(e["bytes"]) in TEXT.encode()  # a piece of the target, never U+FFFD
    raw, content = joined(entries), choice["message"]["content"]
    try:
        assert raw.decode() == content
    except UnicodeDecodeError:
        assert "\ufffd" in content  # the decoder's rendering of the stray bytes
    text, s_entries, _ = streamed(client, logit_bias=bias, max_tokens=12)
    assert text == content
    assert_same_entries(s_entries, entries)


def test_sampled_end_of_sequence_adds_no_bytes(client) -> None:
    # the model's own end-of-sequence token (biased up after two tokens) is listed with
    # its text as the token and no bytes: it is not part of the content
    bias = {str(i): 100 for i in client.eos}
    choice = plain(client, logit_bias=bias, min_tokens=2)
    entries = choice["logprobs"]["content"]
    assert len(entries) == 3 and choice["finish_reason"] == "stop"
    assert entries[-1]["token"] == client.tok.convert_ids_to_tokens(client.eos[0])
    assert entries[-1]["bytes"] == []
    assert joined(entries).decode(errors="replace") == choice["message"]["content"]
    assert_same_entries(streamed(client, logit_bias=bias, min_tokens=2)[1], entries)


def test_named_tool_call_bytes_join_to_the_arguments(client) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["\u5317\u4eac", "\u4e0a\u6d77 \U0001f600"]}},
                "required": ["city"],
            },
        },
    }
    kw = {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "weather"}}}
    r = client.post("/v1/chat/completions", json=body(**kw))
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    arguments = choice["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments)["city"] in ("\u5317\u4eac", "\u4e0a\u6d77 \U0001f600")
    entries = choice["logprobs"]["content"]
    assert joined(entries) == arguments.encode()
    assert len(entries) == out["usage"]["completion_tokens"]  # no forced end token
