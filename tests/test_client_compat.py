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


def _runs(types: list[str]) -> list[str]:
    """``types`` with each run of equal ones as one."""
    return [t for k, t in enumerate(types) if k == 0 or types[k - 1] != t]


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
    # a slow reader gets a request's new text merged into fewer deltas: compare the
    # sequence with each run of deltas as one
    assert _runs([e["type"] for e in events]) == _runs([e["type"] for e in plain])
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
    events = list(
        client.responses.create(**kw, stream=True, stream_options={"include_usage": True})
    )
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

    def text(cs: list[dict]) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in cs)

    assert text(chunks) == text(plain)  # chunk counts may differ: merged while slow
    for c in chunks:
        content = c["choices"][0]["delta"].get("content")
        if content:
            assert (
                ALNUM.match(c["obfuscation"]) and (len(content) + len(c["obfuscation"])) % 32 == 0
            )
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


# ---- part order and the prefix cache --------------------------------------------------
#: The bundled templates' order before this fix (parts rendered where they stand): a
#: checkpoint's template that renders media after text, for the start-up note.
IN_ORDER_TEMPLATE = (
    "{%- for m in messages -%}{{ m['role'] + ': ' }}"
    "{%- if m['content'] is string -%}{{ m['content'] }}{%- else -%}"
    "{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'image' -%}{{ '<image>\\n' }}{%- elif p['type'] == 'text' -%}"
    "{{ p['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}{{ '\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'assistant:' }}{%- endif -%}"
)


@pytest.mark.parametrize("family", ["llava-onevision", "llava-next", "llava"])
def test_a_question_before_the_picture_reuses_the_picture(families, shapes, family) -> None:
    """OpenAI's docs, LangChain and AIPerf put the text part first; the bundled templates
    render media first (as the released llava-hf ones), so a second question about the
    same picture finds the picture's KV in the cache."""
    from tests.helpers import data_url

    engine = families[family].make_engine(max_total_tokens=16384)
    url = data_url(shapes["wide"])
    with app_client(engine) as api:
        usage = []
        for q in ["What is in this picture?", "Which colours do you see?"]:
            parts = [{"type": "text", "text": q}, {"type": "image_url", "image_url": {"url": url}}]
            r = api.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": parts}], "max_tokens": 1},
            )
            assert r.status_code == 200, r.text
            usage.append(r.json()["usage"])
    first, second = usage
    image_tokens = second["prompt_tokens_details"]["image_tokens"]
    assert image_tokens > 0 and first["prompt_tokens_details"]["cached_tokens"] < image_tokens
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert image_tokens <= cached < second["prompt_tokens"] - 3, (cached, second)


def _log_startup(engine, caplog) -> list[str]:
    import logging

    from api.cli import LaunchSettings
    from api.settings import ServerSettings
    from api.startup import log_startup

    with caplog.at_level(logging.INFO, logger="api.cli"):
        log_startup(engine, LaunchSettings(), ServerSettings())
    return [r.getMessage() for r in caplog.records if r.name == "api.cli"]


@pytest.mark.parametrize("family", ["llava", "llava-onevision"])
def test_startup_log_is_silent_on_a_media_first_template(families, family, caplog) -> None:
    lines = _log_startup(families[family].make_engine(max_total_tokens=4096), caplog)
    assert any("serving" in ln for ln in lines)
    assert not any("part order" in ln for ln in lines), lines


def test_startup_log_notes_a_template_that_renders_media_after_text(
    families, tmp_path, caplog
) -> None:
    import shutil

    from mmserve.config import EngineConfig
    from mmserve.frontend.frontend import Engine

    model = tmp_path / "in-order"
    shutil.copytree(families["llava"].model_dir, model)
    (model / "chat_template.jinja").write_text(IN_ORDER_TEMPLATE)
    engine = Engine(EngineConfig(model_path=str(model), max_total_tokens=4096))
    assert engine.processor.prompts.renders_media_after_text()
    notes = [ln for ln in _log_startup(engine, caplog) if "part order" in ln]
    assert len(notes) == 1 and "only the prefix" in notes[0] and "docs/api.md" in notes[0]


# ---- files.create(purpose="vision") -----------------------------------------------------
def test_openai_client_vision_file_is_an_image_for_chat_and_responses(client, api, photos):
    import io

    f = client.files.create(file=("cat.png", io.BytesIO(photos["cat.png"])), purpose="vision")
    assert f.purpose == "vision" and f.object == "file" and f.filename == "cat.png"
    assert f.bytes == len(photos["cat.png"]) and f.status == "processed"
    image = api.get(f"/v1/images/{f.id}")  # the same image as POST /v1/images stores
    assert image.status_code == 200 and image.json()["bytes"] == f.bytes
    assert api.post("/v1/images", files={"file": ("x.png", photos["cat.png"])}).json()["id"] == f.id
    tokens = image.json()["num_image_tokens"]

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What animal is this?"},
                    {"type": "image_url", "image_url": {"url": f.id}},
                ],
            }
        ],
        max_tokens=2,
    )
    assert chat.usage.prompt_tokens_details.image_tokens == tokens
    resp = client.responses.create(
        model=MODEL,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Which colours are there?"},
                    {"type": "input_image", "file_id": f.id},
                ],
            }
        ],
        max_output_tokens=2,
    )
    details = resp.usage.input_tokens_details
    # the same image: its KV (after the shared start of the prompt) comes from the cache
    assert details.image_tokens == tokens and details.cached_tokens >= tokens

    got = client.files.retrieve(f.id)
    assert (got.id, got.purpose, got.bytes, got.filename) == (f.id, "vision", f.bytes, "cat.png")
    assert client.files.content(f.id).read() == photos["cat.png"]
    assert f.id in [x.id for x in client.files.list(purpose="vision")]
    assert f.id in [x.id for x in client.files.list()]
    assert f.id not in [x.id for x in client.files.list(purpose="batch")]
    assert client.files.delete(f.id).deleted
    assert api.get(f"/v1/images/{f.id}").status_code == 404
    assert api.get(f"/v1/files/{f.id}").status_code == 404
    assert api.delete(f"/v1/files/{f.id}").status_code == 404


@pytest.mark.parametrize(
    ("data", "words"),
    [(b"not an image at all", "file: "), (b"", "empty")],
)
def test_a_vision_file_that_is_not_an_image_is_a_400_naming_file(api, data, words) -> None:
    r = api.post("/v1/files", files={"file": ("x.png", data)}, data={"purpose": "vision"})
    err = assert_error(r, 400, words)
    assert err["param"] == "file"


def test_a_vision_file_over_max_image_bytes_is_refused(api, photos) -> None:
    limit = api.app.state.mm.engine.config.image_limits.max_bytes
    big = photos["cat.png"] + b"\0" * (limit + 1 - len(photos["cat.png"]))
    r = api.post("/v1/files", files={"file": ("x.png", big)}, data={"purpose": "vision"})
    err = assert_error(r, 400, "--max-image-bytes", "file_too_large")
    assert err["param"] == "file"


@pytest.mark.parametrize(
    ("part", "param", "words"),
    [
        ({"file_id": "file-" + "0" * 24}, "file_id", "purpose vision"),
        ({"file_id": "img-" + "0" * 32}, "file_id", "unknown image id"),
        ({"file_id": "img-" + "0" * 32, "image_url": "img-" + "0" * 32}, "file_id", "not both"),
        ({}, "image_url", "file_id"),
    ],
)
def test_responses_file_id_errors_name_the_field(api, part, param, words) -> None:
    body = {**RESP, "input": [{"role": "user", "content": [{"type": "input_image", **part}]}]}
    err = assert_error(api.post("/v1/responses", json=body), 400, words)
    assert err["param"] == f"input[0].content[0].{param}"


def test_batch_order_follows_the_templates_part_order(api) -> None:
    """Questions put before their pictures: the bundled template renders each picture
    first, so the cache-aware batch order keeps each picture's questions together."""
    from api.batch.lines import validate
    from api.endpoints.chat import CHAT

    a, b = "img-" + "a" * 32, "img-" + "b" * 32
    rows = []
    for i, (q, url) in enumerate([("A?", a), ("B?", b), ("C?", a), ("D?", b)]):
        parts = [{"type": "text", "text": q}, {"type": "image_url", "image_url": {"url": url}}]
        body = {"messages": [{"role": "user", "content": parts}]}
        line = {"custom_id": f"q{i}", "method": "POST", "url": CHAT.path, "body": body}
        rows.append(json.dumps(line))
    valid, errors = validate("\n".join(rows).encode(), CHAT, api.app.state.mm)
    assert errors == []
    order = [ln.custom_id for ln in sorted(valid, key=lambda ln: ln.key)]
    urls = {"q0": a, "q1": b, "q2": a, "q3": b}
    runs = [urls[c] for c in order]
    assert runs in ([a, a, b, b], [b, b, a, a]), order


def test_a_multipart_field_given_twice_or_too_many_files_is_a_400_naming_it(api, photos) -> None:
    """A repeated field would be acted on once (which one?): refused, naming it; too many
    files is a malformed body naming ``file``, never an error that names no field."""
    cat = photos["cat.png"]
    image = {"file": ("cat.png", cat, "image/png")}
    r = api.post("/v1/files", data={"purpose": ["vision", "batch"]}, files=image)
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose", r.text
    two_files = [("purpose", ("p.png", cat, "image/png")), ("file", ("c.png", cat, "image/png"))]
    r = api.post("/v1/files", files=two_files)
    assert r.status_code == 400 and r.json()["error"]["param"] == "file", r.text
    r = api.post("/v1/images", data={"name": ["a", "b"]}, files=image)
    assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text
