"""``/v1/responses`` through the official ``openai`` client against a live ``mmserve serve``."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import openai
import pytest

from tests.live_server import live_server

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(model_dir: Path):
    args = ["--served-model-name", MODEL, "--max-total-tokens", "8192"]
    with live_server(model_dir, *args) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _image_input(url: str, question: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "input_image", "image_url": url, "detail": "auto"},
                {"type": "input_text", "text": question},
            ],
        }
    ]


def test_text_input_equals_the_chat_completion(client: openai.OpenAI) -> None:
    resp = client.responses.create(
        model=MODEL,
        input="Name a colour.",
        instructions="Be brief.",
        max_output_tokens=6,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
        ],
        max_tokens=6,
        temperature=0,
    )
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == chat.choices[0].message.content
    assert resp.output[0].type == "message" and resp.output[0].role == "assistant"
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    # the chat request ran second with the same prompt: all but the last token cached
    assert chat.usage.prompt_tokens_details.cached_tokens == chat.usage.prompt_tokens - 1
    if chat.choices[0].finish_reason == "length":
        assert resp.status == "incomplete"
        assert resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == "completed"


def test_image_input_data_url_and_upload_id_hit_the_cache(client, photos) -> None:
    url = "data:image/png;base64," + base64.b64encode(photos["cat.png"]).decode()
    first = client.responses.create(
        model=MODEL, input=_image_input(url, "What is this?"), max_output_tokens=4, temperature=0
    )
    assert first.usage.input_tokens > 576
    assert first.usage.input_tokens_details.cached_tokens < 576
    info = client.post(
        "/images", body={"data": base64.b64encode(photos["cat.png"]).decode()}, cast_to=object
    )
    second = client.responses.create(
        model=MODEL,
        input=_image_input(info["id"], "What colour?"),
        max_output_tokens=4,
        temperature=0,
    )
    assert second.usage.input_tokens_details.cached_tokens >= 576


def test_stream_sends_the_event_sequence_and_the_same_text(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "input": "Tell me a story.", "max_output_tokens": 8, "temperature": 0}
    plain = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    head = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    tail = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if plain.status == "completed" else "response.incomplete",
    ]
    assert kinds[:4] == head and kinds[-4:] == tail
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_text_format_json_schema_is_enforced(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"animal": {"type": "string", "enum": ["cat", "dog"]}},
        "required": ["animal"],
        "additionalProperties": False,
    }
    resp = client.responses.create(
        model=MODEL,
        input="Which animal?",
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}},
        max_output_tokens=40,
        temperature=0,
    )
    assert resp.status == "completed"
    assert json.loads(resp.output_text)["animal"] in ("cat", "dog")
    assert resp.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
    ],
)
def test_unsupported_fields_are_refused_by_name(client, extra, field) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, **extra)
    err = exc.value.body
    assert err["param"] == field and field in err["message"]


def test_bad_input_is_a_400_naming_the_part(client: openai.OpenAI) -> None:
    bad = [{"role": "user", "content": [{"type": "input_image", "image_url": "img-nope"}]}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL, input=bad, max_output_tokens=2)
    assert exc.value.body["param"].startswith("input[0].content[0]")
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(
            model=MODEL,
            input="Hi",
            text={"format": {"type": "json_schema", "name": "x"}},
            max_output_tokens=2,
        )
    assert exc.value.body["param"] == "text.format.schema"
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(
            model=MODEL,
            input=[{"type": "function_call_output", "call_id": "c", "output": "x"}],
            max_output_tokens=2,
        )
    assert exc.value.body["param"].startswith("input[0]")


@pytest.mark.parametrize(
    ("part", "param", "words"),
    [
        ({"type": "input_image", "file_id": "file-1"}, "input[0].content[0].file_id", "/v1/images"),
        (
            {"type": "input_image", "image_url": "img-" + "0" * 32, "detail": "medium"},
            "input[0].content[0].detail",
            "'low'",
        ),
        ({"type": "input_audio", "data": "x"}, "input[0].content[0].type", "'input_image'"),
    ],
)
def test_a_bad_part_is_blamed_on_its_own_field(client, part, param, words) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(
            model=MODEL, input=[{"role": "user", "content": [part]}], max_output_tokens=2
        )
    err = exc.value.body
    assert err["param"] == param and words in err["message"], err
