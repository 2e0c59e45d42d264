"""The official ``openai`` client against a real ``mmserve serve`` with an API key."""

from __future__ import annotations

import base64
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.live_server import get_json, live_server

KEY = "sk-test-mmserve"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(model_dir: Path):
    args = ["--served-model-name", MODEL, "--max-total-tokens", "8192", "--api-key", KEY]
    with live_server(model_dir, *args) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def image_message(image_url: str, question: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_url}},
                {"type": "text", "text": question},
            ],
        }
    ]


def test_chat_with_an_image_then_cached_second_question(client, photos) -> None:
    url = "data:image/png;base64," + base64.b64encode(photos["cat.png"]).decode()
    first = client.chat.completions.create(
        model=MODEL, messages=image_message(url, "What is this?"), max_tokens=5, temperature=0
    )
    assert first.object == "chat.completion"
    assert first.choices[0].finish_reason in ("length", "stop")
    assert first.choices[0].message.content and first.usage.completion_tokens <= 5
    assert first.usage.prompt_tokens > 576
    assert first.usage.prompt_tokens_details.cached_tokens < 576
    second = client.chat.completions.create(
        model=MODEL, messages=image_message(url, "What colour?"), max_tokens=5, temperature=0
    )
    # the image and the text before it are reused; the other question is not
    assert 576 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens - 1


def test_streamed_chat_with_an_uploaded_image(client, photos) -> None:
    info = client.post(
        "/images",
        body={"data": base64.b64encode(photos["rocket.jpg"]).decode()},
        cast_to=object,
    )
    assert info["id"].startswith("img-") and info["num_image_tokens"] == 576
    msgs = image_message(info["id"], "Describe it.")
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == plain.choices[0].finish_reason
    usage = chunks[-1].usage
    assert usage.completion_tokens == plain.usage.completion_tokens
    # the same prompt again: all of it but the token that gives the first logits
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_logprobs_n_and_models_through_the_client(client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=3,
        temperature=0.8,
        seed=1,
        n=2,
        logprobs=True,
        top_logprobs=5,
    )
    assert len(out.choices) == 2
    for choice in out.choices:
        assert len(choice.logprobs.content) == 3
        assert all(len(t.top_logprobs) == 5 for t in choice.logprobs.content)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10**7
        )
    assert "context" in e.value.message


def test_api_key_is_required_except_for_health(server: str) -> None:
    assert get_json(f"{server}/health") == {"status": "ok"}
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    for path, headers in [
        ("/v1/models", {}),
        ("/metrics", {}),
        ("/v1/cache/stats", {"Authorization": f"Bearer {KEY}x"}),
        ("/openapi.json", {"Authorization": KEY}),
    ]:
        with pytest.raises(urllib.error.HTTPError) as e:
            get_json(f"{server}{path}", headers)
        assert e.value.code == 401
        assert e.value.headers["WWW-Authenticate"] == "Bearer"
    ok = get_json(f"{server}/v1/cache/stats", {"Authorization": f"Bearer {KEY}"})
    assert ok["pool_pages"] == 8192
    req = urllib.request.Request(f"{server}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert b"mmserve_cache_hit_rate" in r.read()


def test_assistant_prefill_and_message_rules_through_the_client(client) -> None:
    ask = {"role": "user", "content": "Where is the tower?"}
    prefill = {"role": "assistant", "content": "The city is"}
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    out = client.chat.completions.create(
        model=MODEL, messages=[ask, prefill], max_tokens=4, temperature=0, extra_body=flags
    )
    again = client.chat.completions.create(
        model=MODEL, messages=[ask, prefill], max_tokens=4, temperature=0, extra_body=flags
    )
    assert again.choices[0].message.content == out.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == out.usage.prompt_tokens - 1
    # without the flags the closed assistant turn is followed by a new one: a longer prompt
    turn = client.chat.completions.create(
        model=MODEL, messages=[ask, prefill], max_tokens=4, temperature=0, user="alice"
    )
    assert turn.usage.prompt_tokens > out.usage.prompt_tokens
    # the client sends the previous answer back as it was returned
    follow = [ask, turn.choices[0].message, {"role": "user", "content": "Sure?"}]
    assert client.chat.completions.create(model=MODEL, messages=follow, max_tokens=2).choices
    for messages, param in [
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([ask], "continue_final_message"),
        ([ask, {"role": "tool", "content": "42"}], "messages[1].tool_call_id"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=2, extra_body=flags
            )
        assert e.value.body["param"] == param, e.value.body
