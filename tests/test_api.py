"""The HTTP API in-process: uploads, chat completions, and 4xx errors that leave it healthy."""

from __future__ import annotations

import base64

import pytest
from fastapi.testclient import TestClient

from api.app import ServerSettings, create_app
from tests.helpers import assert_healthy, chat, stream_chunks, upload, user
from tests.live_server import app_failing_prefill

MODEL = "llava-tiny"


@pytest.fixture(scope="module")
def client(make_engine):
    engine = make_engine(max_total_tokens=8192)
    app = create_app(engine, ServerSettings(served_model_name=MODEL))
    with TestClient(app) as c:
        c.engine = engine
        yield c


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def ask(image_id: str, q: str) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": image_id}}, {"type": "text", "text": q}]


def test_upload_same_pixels_same_id(client, photos) -> None:
    a = upload(client, photos["cat.png"], "cat.png").json()
    b = upload(client, photos["cat.png"], "renamed.png").json()
    assert a["id"] == b["id"] and a["id"].startswith("img-")
    assert (a["width"], a["height"], a["num_image_tokens"]) == (451, 300, 576)
    assert client.get(f"/v1/images/{a['id']}").json()["id"] == a["id"]


def test_three_questions_reuse_the_image(client, photos) -> None:
    assert client.post("/v1/cache/flush").status_code == 200  # whatever other tests cached
    image_id = upload(client, photos["coffee.png"]).json()["id"]
    proc = client.engine.processor
    image = proc.prepare_image(photos["coffee.png"])
    asked: list[list[int]] = []
    for q in ["What is this?", "What colour is the cup?", "Is it hot?"]:
        r = chat(client, ask(image_id, q))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["message"]["content"]
        ids = proc.make_request(messages=user(None, q), images=[image]).input_ids
        assert body["usage"]["prompt_tokens"] == len(ids) > 576
        # page size 1: the cache holds each earlier prompt; the match is the longest
        # shared prefix (image included), never the whole prompt
        want = max((shared_prefix(ids, before) for before in asked), default=0)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == min(want, len(ids) - 1)
        asked.append(ids)
    assert min(shared_prefix(asked[0], a) for a in asked[1:]) > 576  # the image was reused


def test_data_url_equals_upload(client, photos) -> None:
    image_id = upload(client, photos["rocket.jpg"]).json()["id"]
    url = "data:image/jpeg;base64," + base64.b64encode(photos["rocket.jpg"]).decode()
    a = chat(client, ask(image_id, "What is this?")).json()
    b = chat(client, ask(url, "What is this?")).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    # the same prompt again: all of it but the token that gives the first logits
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == b["usage"]["prompt_tokens"] - 1


def test_streaming_sse(client, photos) -> None:
    image_id = upload(client, photos["cat.png"]).json()["id"]
    plain = chat(client, ask(image_id, "Stream?")).json()["choices"][0]["message"]["content"]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": ask(image_id, "Stream?")}],
        "max_tokens": 3,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    chunks = stream_chunks(client, body)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)


@pytest.mark.parametrize(
    "content, kw, status, words",
    [
        (ask("img-" + "0" * 32, "hi"), {}, 400, "unknown image id"),
        (ask("https://example.com/a.png", "hi"), {}, 400, "POST /v1/images"),
        (ask("data:image/png;base64,@@@not-base64", "hi"), {}, 400, "not valid base64"),
        (ask("data:image/png;base64,", "hi"), {}, 400, "empty"),
        ("hello", {"max_tokens": -1}, 400, "max_tokens"),
        ("hello", {"max_tokens": 10**6}, 400, "context"),
        ("hello", {"temperature": -0.5}, 400, "temperature"),
        ("hello", {"model": "gpt-4"}, 404, "does not exist"),
        ("what is <image> this", {}, 400, "placeholder"),
    ],
)
def test_bad_requests_get_clear_errors(client, content, kw, status, words) -> None:
    r = chat(client, content, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and set(err) == {"message", "type", "param", "code"}
    assert_healthy(client)


def test_malformed_json(client) -> None:
    r = client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert_healthy(client)


@pytest.mark.parametrize(
    "name", ["empty.png", "truncated.png", "not-an-image.jpg", "bomb-header-50000.png"]
)
def test_bad_uploads(client, cases_dir, name) -> None:
    r = upload(client, (cases_dir / name).read_bytes(), name)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_image"
    assert_healthy(client)


def test_unknown_image_get_is_404(client) -> None:
    r = client.get("/v1/images/img-" + "1" * 32)
    assert r.status_code == 404 and "no image" in r.json()["error"]["message"]


def test_models_and_health(client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL


def test_engine_failure_answers_500_not_a_hang(make_engine, tmp_path) -> None:
    engine = make_engine(max_total_tokens=4096)
    flag = tmp_path / "fail"
    flag.touch()  # prefills fail (in the engine process, in the process-split run)
    with TestClient(app_failing_prefill(engine, flag, served_model_name=MODEL)) as c:
        r = chat(c, "hello")
        err = r.json()["error"]
        assert r.status_code == 500 and "RuntimeError" in err["message"], err
        assert "req-" in err["message"] and "/secret" not in err["message"]
        assert err["type"] == "server_error"
        assert c.get("/health").status_code == 200  # one failed step is not a dead engine
        stats = c.get("/v1/cache/stats").json()
        assert stats["free_pages"] == stats["pool_pages"] and stats["live_requests"] == 0
