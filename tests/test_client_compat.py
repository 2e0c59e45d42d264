"""What a new user's clients send (the ``openai`` client, langchain-openai, AIPerf):
``stream_options`` on ``/v1/responses``, ``files.create(purpose="vision")``, and a
question put before the picture hitting the prefix cache. In-process app, tiny models."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.helpers import MODEL, assert_error, stream_chunks
from tests.live_server import app_client

ALNUM = re.compile(r"^[A-Za-z0-9]+$")


@pytest.fixture(scope="module")
def api(make_engine, tmp_path_factory):
    data = tmp_path_factory.mktemp("compat-data")
    with app_client(make_engine(max_total_tokens=8192), data_dir=str(data)) as c:
        yield c


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=api, max_retries=0
    )


def _response_events(api, body: dict) -> list[dict]:
    """POST a streamed ``/v1/responses`` body; the parsed events."""
    with api.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    return [json.loads(ln[6:]) for ln in lines]


RESP = {"model": MODEL, "input": "Tell me a story.", "max_output_tokens": 6, "temperature": 0}


# ---- stream_options on /v1/responses ----------------------------------------------------
@pytest.mark.parametrize(
    "options",
    [{"include_usage": True}, {"include_usage": False}, {"include_obfuscation": False}, {}],
)
def test_responses_accepts_stream_options_without_padding(api, options) -> None:
    events = _response_events(api, {**RESP, "stream_options": options})
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all("obfuscation" not in e for e in events)
    final = events[-1]
    assert final["type"] in ("response.completed", "response.incomplete")
    usage = final["response"]["usage"]  # usage is in the last event whatever include_usage says
    assert usage["output_tokens"] == 6 or final["type"] == "response.completed"
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_responses_include_obfuscation_pads_every_delta_event(api) -> None:
    plain = _response_events(api, RESP)
    events = _response_events(
        api, {**RESP, "stream_options": {"include_obfuscation": True, "include_usage": True}}
    )
    assert [e["type"] for e in events] == [e["type"] for e in plain]
    for e in events:
        if e["type"].endswith(".delta"):
            pad = e["obfuscation"]
            assert ALNUM.match(pad) and (len(e["delta"]) + len(pad)) % 32 == 0, e
        else:
            assert "obfuscation" not in e
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "".join(e["delta"] for e in plain if e["type"] == "response.output_text.delta")


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({**RESP, "stream": True, "stream_options": {"include_bytes": True}}, None, "unknown"),
        ({**RESP, "stream": True, "stream_options": {"include_usage": "yes"}}, None, "bool"),
        ({**RESP, "stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({**RESP, "stream": False, "stream_options": {}}, "stream_options", "stream"),
    ],
)
def test_responses_refuses_bad_stream_options_by_name(api, body, param, words) -> None:
    err = assert_error(api.post("/v1/responses", json=body), 400, words)
    if param is None:  # the key at fault inside stream_options
        key = next(iter(body["stream_options"]))
        assert err["param"] == f"stream_options.{key}", err
    else:
        assert err["param"] == param


def test_openai_client_streams_a_response_with_stream_options(client) -> None:
    kw = {"model": MODEL, "input": "Tell me a story.", "max_output_tokens": 6, "temperature": 0}
    plain = client.responses.create(**kw)
    events = list(
        client.responses.create(**kw, stream=True, stream_options={"include_obfuscation": True})
    )
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == plain.output_text
    assert all(ALNUM.match(e.obfuscation) for e in deltas)
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens
    # AIPerf's shape: include_usage
    events = list(client.responses.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert events[-1].type == f"response.{plain.status}"
    assert events[-1].response.usage.input_tokens == plain.usage.input_tokens


def test_chat_include_obfuscation_pads_text_chunks_only(api) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 5,
        "temperature": 0,
    }
    plain = stream_chunks(api, body)
    chunks = stream_chunks(api, {**body, "stream_options": {"include_obfuscation": True}})
    assert len(chunks) == len(plain)
    for c in chunks:
        content = c["choices"][0]["delta"].get("content")
        if content:
            assert ALNUM.match(c["obfuscation"]) and (len(content) + len(c["obfuscation"])) % 32 == 0
        else:
            assert "obfuscation" not in c
    assert any("obfuscation" in c for c in chunks)


@pytest.mark.parametrize("endpoint", ["/v1/responses", "/v1/chat/completions"])
def test_a_batch_line_refuses_stream_options_on_both_endpoints(api, endpoint) -> None:
    from api.batch.lines import validate
    from api.endpoints.chat import CHAT
    from api.endpoints.responses import RESPONSES

    handler = RESPONSES if endpoint == "/v1/responses" else CHAT
    if endpoint == "/v1/responses":
        body = {**RESP, "stream_options": {"include_usage": True}}
    else:
        body = {"messages": [{"role": "user", "content": "Hi"}], "stream_options": {}}
    line = {"custom_id": "a", "method": "POST", "url": endpoint, "body": body}
    valid, errors = validate(json.dumps(line).encode(), handler, api.app.state.mm)
    assert valid == [] and errors[0]["error"]["param"] == "body.stream_options", errors
