"""Request fields are acted on or refused: unknown fields at every level of every route,
known OpenAI fields the server does not act on, and tool calling (``tools``,
``tool_choice``, ``parallel_tool_calls``) enforced by constrained decoding, through the
official ``openai`` client (its HTTP client is the app's TestClient: no server process).
"""

from __future__ import annotations

import base64
import json

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from api.app import ServerSettings, create_app
from api.structured import MAX_PARALLEL_TOOL_CALLS, ToolCalling, _calls_schema
from mmserve.structured.spec import GuidedSpec
from tests.helpers import assert_error, assert_healthy, image_part, png_bytes

MODEL = "llava-tiny"

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
# both define $defs.item, differently: the "required" grammar must keep them apart
CALC = {
    "type": "object",
    "properties": {
        "op": {"enum": ["add", "mul"]},
        "args": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["op", "args"],
    "$defs": {"item": {"type": "integer", "minimum": 0, "maximum": 99}},
}
TAG = {
    "type": "object",
    "properties": {"tag": {"$ref": "#/$defs/item"}},
    "required": ["tag"],
    "$defs": {"item": {"enum": ["red", "green", "blue"]}},
}
SCHEMAS = {"get_weather": WEATHER, "calc": CALC, "tag": TAG}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": f"the {n} tool", "parameters": s}}
    for n, s in SCHEMAS.items()
]
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture(scope="module")
def app(make_engine):
    engine = make_engine(max_total_tokens=16384)
    with TestClient(create_app(engine, ServerSettings(served_model_name=MODEL, max_n=8))) as c:
        c.engine = engine
        yield c


@pytest.fixture(scope="module")
def client(app: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=app, max_retries=0
    )


@pytest.fixture(scope="module")
def image_id(app: TestClient) -> str:
    from PIL import Image

    r = app.post("/v1/images", files={"file": ("a.png", png_bytes(Image.new("RGB", (8, 8))))})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def assert_valid_calls(calls, n_min: int = 1, n_max: int = 99) -> None:
    """Every call has the OpenAI shape and arguments valid under its tool's schema."""
    assert n_min <= len(calls) <= n_max
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        schema = SCHEMAS[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    assert len({c.id for c in calls}) == len(calls)


# ---- unknown fields: a 400 naming the full path, on every route and level -------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
IMAGE_MSG = [{"role": "user", "content": [image_part("IMG"), {"type": "text", "text": "x"}]}]
VIDEO_MSG = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "vid-0"}}]}]
TEXT = {"type": "text"}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}


def _with(body: dict, path: list, value: object = 1) -> dict:
    """A deep copy of ``body`` with ``value`` set at ``path`` (keys and indexes)."""
    body = json.loads(json.dumps(body))
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return body


UNKNOWN = [
    ("/v1/chat/completions", CHAT, ["frobnicate"]),
    ("/v1/chat/completions", CHAT, ["messages", 0, "colour"]),
    ("/v1/chat/completions", {**CHAT, "messages": IMAGE_MSG}, ["messages", 0, "content", 1, "x"]),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": IMAGE_MSG},
        ["messages", 0, "content", 0, "image_url", "x"],
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": VIDEO_MSG},
        ["messages", 0, "content", 0, "video_url", "x"],
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "stream": True, "stream_options": {}},
        ["stream_options", "x"],
    ),
    ("/v1/chat/completions", {**CHAT, "response_format": TEXT}, ["response_format", "x"]),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": SCHEMA_FORMAT},
        ["response_format", "json_schema", "x"],
    ),
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS}, ["tools", 1, "x"]),
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS}, ["tools", 1, "function", "x"]),
    ("/v1/chat/completions", {**CHAT, "tool_choice": named("calc")}, ["tool_choice", "x"]),
    (
        "/v1/chat/completions",
        {**CHAT, "tool_choice": named("calc")},
        ["tool_choice", "function", "x"],
    ),
    ("/v1/images/IMG/ask", {"questions": ["x"], "max_tokens": 2}, ["x"]),
    (
        "/v1/images/IMG/ask",
        {"questions": ["x"], "response_format": SCHEMA_FORMAT},
        ["response_format", "json_schema", "x"],
    ),
    ("/v1/videos/vid-0/qa", {"questions": ["x"], "num_frames": 2}, ["frame_rate"]),
    ("/v1/images", {"data": "AAAA"}, ["purpose"]),
    ("/v1/videos", {"data": "AAAA"}, ["purpose"]),
]


@pytest.mark.parametrize(
    "route, body, path", UNKNOWN, ids=[f"{r} {'.'.join(map(str, p))}" for r, _, p in UNKNOWN]
)
def test_unknown_field_is_a_400_naming_its_path(app, image_id, route, body, path) -> None:
    route = route.replace("IMG", image_id)
    body = json.loads(json.dumps(body).replace('"IMG"', json.dumps(image_id)))
    want = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    ok = app.post(route, json=body)  # without the field: answered, or refused for another reason
    assert ok.status_code != 400 or ok.json()["error"]["param"] != want, ok.text
    r = app.post(route, json=_with(body, path))
    err = assert_error(r, 400, want)
    assert err["param"] == want
    assert err["message"].startswith(f"{want}: ")
    assert "unknown" in err["message"] and "refused" in err["message"]


def test_multipart_upload_with_another_field_is_refused(app) -> None:
    from PIL import Image

    data = png_bytes(Image.new("RGB", (4, 4)))
    for route in ("/v1/images", "/v1/videos"):
        r = app.post(route, files={"file": ("a.png", data)}, data={"purpose": "vision"})
        assert assert_error(r, 400, "purpose")["param"] == "purpose"


# ---- known OpenAI fields the server does not act on -----------------------------------
UNSUPPORTED = [
    (["metadata"], {"k": "v"}),
    (["store"], True),
    (["service_tier"], "flex"),
    (["modalities"], ["text", "audio"]),
    (["audio"], {"voice": "alloy", "format": "wav"}),
    (["prediction"], {"type": "content", "content": "x"}),
    (["reasoning_effort"], "low"),
    (["verbosity"], "high"),
    (["web_search_options"], {}),
    (["functions"], [{"name": "f", "parameters": {}}]),
    (["function_call"], "auto"),
    (["messages", 0, "name"], "alice"),
    (["messages", 0, "content", 1, "image_url"], {"url": "IMG"}),  # on a text part
    (["messages", 0, "content", 0, "num_frames"], 3),  # on an image part
    (["messages", 0, "role"], "function"),
    (["messages", 0, "tool_call_id"], "call_1"),
    (["stream_options"], {"include_usage": True}),  # without stream
]
DEFAULTS = [
    (["user"], None),
    (["user"], "alice"),  # accepted and logged
    (["prompt_cache_key"], "k"),  # acted on under --replicas (issue 42)
    (["prompt_cache_retention"], "in_memory"),
    (["cache_salt"], "s"),
    (["safety_identifier"], "hash-1"),
    (["metadata"], {}),
    (["store"], False),
    (["service_tier"], "auto"),
    (["modalities"], ["text"]),
    (["parallel_tool_calls"], True),
    (["tool_choice"], "none"),
    (["messages", 0, "content", 0, "image_url", "detail"], "auto"),
    (["messages", 0, "content", 0, "image_url", "detail"], "low"),  # acted on: test_detail.py
    (["messages", 0, "content", 0, "image_url", "detail"], "high"),
    (["messages", 0, "tool_calls"], []),
]


def _image_chat(image_id: str, path: list, value: object) -> dict:
    msgs = json.loads(json.dumps(IMAGE_MSG).replace('"IMG"', json.dumps(image_id)))
    value = json.loads(json.dumps(value).replace('"IMG"', json.dumps(image_id)))
    return _with({**CHAT, "messages": msgs}, path, value)


@pytest.mark.parametrize("path, value", UNSUPPORTED, ids=[repr(u) for u in UNSUPPORTED])
def test_known_field_not_acted_on_is_refused(app, image_id, path, value) -> None:
    r = app.post("/v1/chat/completions", json=_image_chat(image_id, path, value))
    want = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    err = assert_error(r, 400, want)
    assert err["param"] == want
    assert "not" in err["message"] and ("supported" in err["message"] or "used" in err["message"])
    assert "!r}" not in err["message"] and "{why}" not in err["message"]  # templates filled


@pytest.mark.parametrize("path, value", DEFAULTS, ids=[repr(d) for d in DEFAULTS])
def test_known_field_at_its_default_is_accepted(app, image_id, path, value) -> None:
    r = app.post("/v1/chat/completions", json=_image_chat(image_id, path, value))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def test_frame_fields_on_both_part_and_video_url_are_refused(app) -> None:
    part = {"type": "video_url", "video_url": {"url": "vid-0", "num_frames": 2}, "fps": 1.0}
    body = {**CHAT, "messages": [{"role": "user", "content": [part]}]}
    err = assert_error(app.post("/v1/chat/completions", json=body), 400, "one place")
    assert err["param"] == "messages[0].content[0].fps"


# ---- tool calling ---------------------------------------------------------------------
def test_required_picks_among_the_tools_with_valid_arguments(client, app) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=150,
        temperature=1.0, seed=5, n=4,
    )  # fmt: skip
    names = set()
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert_valid_calls(choice.message.tool_calls)
        names |= {c.function.name for c in choice.message.tool_calls}
    assert names <= set(SCHEMAS)
    # one call only when parallel calls are off
    one = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=150,
        temperature=1.0, seed=5, n=4, parallel_tool_calls=False,
    )  # fmt: skip
    for choice in one.choices:
        assert choice.finish_reason == "tool_calls"
        assert_valid_calls(choice.message.tool_calls, 1, 1)
    assert_healthy(app)


def test_named_function_plain_and_streamed_agree(client, app, image_id) -> None:
    msgs = [{"role": "user", "content": [image_part(image_id), {"type": "text", "text": "Sum?"}]}]
    kw = dict(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=named("calc"), max_tokens=150)
    plain = client.chat.completions.create(temperature=0, **kw)
    choice = plain.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert_valid_calls(choice.message.tool_calls, 1, 1)
    assert choice.message.tool_calls[0].function.name == "calc"
    assert plain.usage.completion_tokens > 0

    chunks = list(client.chat.completions.create(temperature=0, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks]
    first = deltas[0].tool_calls[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "calc"
    assert all(d.content is None for d in deltas)
    args = "".join(tc.function.arguments or "" for d in deltas for tc in d.tool_calls or [])
    assert args == choice.message.tool_calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1
    assert_healthy(app)


def test_required_streamed_with_n(client) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=1000,
        temperature=1.0, seed=9, n=3, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    calls: dict[int, dict[int, dict]] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        c = chunk.choices[0]
        assert c.delta.content is None
        for tc in c.delta.tool_calls or []:
            call = calls.setdefault(c.index, {}).setdefault(tc.index, {"arguments": ""})
            if tc.id:
                call["id"], call["name"] = tc.id, tc.function.name
            call["arguments"] += tc.function.arguments or ""
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    assert usage is not None and usage.completion_tokens > 0
    assert all(1 <= len(by_index) <= MAX_PARALLEL_TOOL_CALLS for by_index in calls.values())
    for by_index in calls.values():
        for call in by_index.values():
            assert call["id"].startswith("call_")
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_tool_choice_none_answers_in_text(client) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0
    )
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content == plain.choices[0].message.content
    assert out.choices[0].finish_reason == plain.choices[0].finish_reason


def _streamed_calls(chunks: list) -> tuple[dict[int, dict], str, str]:
    """``(calls by index, content, last finish reason)`` of one streamed choice."""
    calls: dict[int, dict] = {}
    for c in chunks:
        for tc in c.choices[0].delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"arguments": ""})
            if tc.id:
                assert "id" not in call, "a call is announced once"
                call.update(id=tc.id, name=tc.function.name)
            call["arguments"] += tc.function.arguments or ""
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    return calls, content, [c.choices[0].finish_reason for c in chunks][-1]


@pytest.mark.parametrize("max_tokens", [3, 6, 12])
@pytest.mark.parametrize("tool_choice", ["required", "get_weather"])
def test_a_call_cut_by_max_tokens_is_a_tool_call_with_partial_arguments(
    client, tool_choice, max_tokens
) -> None:
    """OpenAI's answer to a cut tool call: ``tool_calls`` holding the arguments generated
    so far, finish reason "length", never the call's JSON as content; streamed the same."""
    required = tool_choice == "required"
    choice_field = tool_choice if required else named(tool_choice)
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice_field,
              max_tokens=max_tokens, temperature=0)  # fmt: skip
    # the same grammar as a response format: its text is what the call is made of
    schema = _calls_schema(SCHEMAS, True) if required else SCHEMAS[tool_choice]
    raw = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=max_tokens, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": schema}},
    )  # fmt: skip
    assert raw.choices[0].finish_reason == "length"
    text = raw.choices[0].message.content
    out = client.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    if required:
        expect = ToolCalling(GuidedSpec("json_object", ""), None, True, tuple(SCHEMAS)).split(text)
    else:
        expect = [(tool_choice, text)]
    assert [(c.function.name, c.function.arguments) for c in calls] == expect
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    if expect:  # the arguments are a prefix of a JSON object, cut
        args = expect[-1][1]
        assert args == "" or args.startswith("{")
        with pytest.raises(ValueError):
            json.loads(args)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed, content, finish = _streamed_calls(chunks)
    assert finish == "length" and content == ""
    assert [(streamed[k]["name"], streamed[k]["arguments"]) for k in sorted(streamed)] == expect
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1


def test_cut_calls_split_as_the_grammar_writes_them() -> None:
    """:meth:`ToolCalling.split` on every prefix of a two-call answer: a call appears once
    its name is known (a cut name completed only when one tool's name fits), and its
    arguments are that prefix of the generated text, growing with it."""
    tools = ToolCalling(GuidedSpec("json_object", ""), None, True, ("calc", "cat", "tag"))
    one = '{"op": "a}\\"d", "args": [1, 2]}'
    two = '{"tag": "red"}'
    full = f'[{{"name": "calc", "arguments": {one}}}, {{"name": "tag", "arguments": {two}}}]'
    calls = [("calc", one), ("tag", two)]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in tools.parse(full)] == calls
    at_one, at_two = full.index(one), full.index(two)
    name = full.index('"calc"') + 1
    assert tools.split(full[:name]) == tools.split(full[: name + 2]) == []  # "ca": calc or cat
    assert tools.split(full[: name + 3]) == [("calc", "")]
    assert tools.split(full[: at_one + 9]) == [("calc", one[:9])]  # cut inside a string
    assert tools.split(full[: at_one + len(one)]) == [("calc", one)]
    assert tools.split(full[: full.index('"tag"') + 2]) == [("calc", one), ("tag", "")]
    assert tools.split(full[: at_two + 3]) == [("calc", one), ("tag", two[:3])]
    assert tools.split(full) == calls
    prev: list = []
    for i in range(len(full) + 1):  # calls and their arguments only ever grow
        got = tools.split(full[:i])
        assert len(got) >= len(prev)
        assert all(
            n1 == n0 and a1.startswith(a0) for (n0, a0), (n1, a1) in zip(prev, got, strict=False)
        )
        prev = got


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_tool_choice_is_refused_with_what_to_do(client, choice) -> None:
    kw = {} if choice is None else {"tool_choice": choice}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=2, **kw)
    assert e.value.body["param"] == "tool_choice"
    assert "required" in e.value.message and "parser" in e.value.message


def _tool(name: str = "f", parameters: object = None, **fn) -> dict:
    function = {"name": name, **fn}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


BAD_TOOLS = [
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type", "function"),
    ({"tools": [_tool("get weather")]}, "tools[0].function.name", "letters"),
    ({"tools": [_tool("f" * 65)]}, "tools[0].function.name", "64"),
    ({"tools": [_tool(), _tool()]}, "tools[1].function.name", "two tools"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "required"),
    ({"tools": []}, "tools", "at least 1"),
    ({"tools": [_tool(f"f{i}") for i in range(129)]}, "tools", "at most 128"),
    ({"tools": [_tool(parameters={"type": "string"})]}, "tools[0].function.parameters.type", ""),
    (
        {"tools": [_tool(parameters={"type": "object", "multipleOf": 2})]},
        "tools[0].function.parameters.multipleOf",
        "not enforced",
    ),
    (
        {"tools": [_tool(parameters={"type": "object", "properties": {"a": {"$ref": "#/x"}}})]},
        "tools[0].function.parameters",
        "",
    ),
    ({"tools": [_tool(parameters=[1])]}, "tools[0].function.parameters", "object"),
    ({"tools": [_tool()], "tool_choice": named("g")}, "tool_choice.function.name", "'f'"),
    ({"tools": [_tool()], "tool_choice": {"type": "function"}}, "tool_choice", ""),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": named("f")}, "tool_choice", "needs tools"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "needs tools"),
    (
        {"tools": [_tool()], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
        "combined",
    ),
    (
        {"tools": [_tool()], "tool_choice": "none", "guided_regex": "a+"},
        "guided_regex",
        "combined",
    ),
    ({"tools": [_tool()], "tool_choice": "any"}, "tool_choice", "'required'"),
]


@pytest.mark.parametrize("extra, param, words", BAD_TOOLS, ids=[b[1] for b in BAD_TOOLS])
def test_bad_tools_are_a_400_naming_the_field(app, extra, param, words) -> None:
    r = app.post("/v1/chat/completions", json={**CHAT, **extra})
    err = assert_error(r, 400, words)
    assert err["param"] == param or (err["param"] or "").startswith(param), err


def test_tool_messages_are_refused(app) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    err = assert_error(app.post("/v1/chat/completions", json={**CHAT, "messages": msgs}), 400, "")
    assert err["param"] in ("messages[1].tool_calls", "messages[2].role")
    assert "user message" in err["message"] or "assistant message" in err["message"]


@settings(max_examples=60, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.from_regex(r"[a-zA-Z0-9_-]{1,64}", fullmatch=True),
            st.dictionaries(
                st.text(max_size=5),
                st.recursive(
                    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda kids: st.lists(kids, max_size=3),
                    max_leaves=5,
                ),
                max_size=3,
            ),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_parse_reads_back_every_call(calls) -> None:
    required = ToolCalling(GuidedSpec("json_object"), None, True)
    text = json.dumps([{"name": n, "arguments": a} for n, a in calls])
    got = required.parse(text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got)
    assert required.parse(text[:-1]) is None  # cut short: no call
    # every prefix (a cut anywhere): calls and their arguments only grow, ending as parsed
    named = ToolCalling(GuidedSpec("json_object"), None, True, tuple({n for n, _ in calls}))
    prev: list = []
    for i in range(len(text) + 1):
        split = named.split(text[:i])
        assert len(split) >= len(prev)
        assert all(
            n1 == n0 and a1.startswith(a0) for (n0, a0), (n1, a1) in zip(prev, split, strict=False)
        )
        prev = split
    assert [(n, json.loads(a)) for n, a in prev] == calls
    one = ToolCalling(GuidedSpec("json_object"), "f", False)
    assert one.parse(json.dumps(calls[0][1]))[0]["function"]["arguments"] == json.dumps(calls[0][1])
    assert one.parse("[1]") is None


def test_json_upload_still_works(app) -> None:
    from PIL import Image

    raw = png_bytes(Image.new("RGB", (5, 4), "red"))
    r = app.post("/v1/images", json={"data": base64.b64encode(raw).decode()})
    assert r.status_code == 200, r.text
    info = r.json()
    assert (info["width"], info["height"]) == (5, 4) and info["id"].startswith("img-")
    # the same pixels uploaded as a file get the same id
    files = {"file": ("red.png", raw, "image/png")}
    assert app.post("/v1/images", files=files).json()["id"] == info["id"]
