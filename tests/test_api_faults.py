"""Faults a fresh user found: malformed ids, bodies cut short, unbounded ``stop``, tool
fields on ``/v1/responses`` without tools. Each answers a 4xx naming the field (or, for a
client gone mid-body, nothing and one log line) and leaves the server as it was."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from api.app import ServerSettings, create_app
from api.schemas import MAX_STOP, MAX_STOP_CHARS
from tests.helpers import assert_error, assert_healthy, chat, image_part, user

MODEL = "llava-tiny"
HEX32 = "0123456789abcdef" * 2


@pytest.fixture(scope="module")
def client(make_engine, shapes, tmp_path_factory):
    engine = make_engine(max_total_tokens=4096)
    settings = ServerSettings(
        served_model_name=MODEL, data_dir=str(tmp_path_factory.mktemp("faults-data"))
    )
    with TestClient(create_app(engine, settings)) as c:
        c.image_id = c.post("/v1/images", files={"file": ("a.png", shapes["square"])}).json()["id"]
        yield c


def _chat_image(client, url: str, as_object: bool = True):
    part = image_part(url) if as_object else {"type": "image_url", "image_url": url}
    return chat(client, [part, {"type": "text", "text": "Hi"}], max_tokens=1)


# ---- 1. malformed ids --------------------------------------------------------------------
@pytest.mark.parametrize(
    "url, words",
    [
        ("img-deadbeef", "malformed"),
        ("deadbeef", "malformed"),
        ("IMG-" + HEX32.upper(), "malformed"),
        ("img-" + HEX32 + "0", "malformed"),
        ("mmserve://images/img-zz", "malformed"),
        ("vid-" + HEX32, "that is a video id, not an image id"),
        ("file-" + HEX32[:24], "that is a file id, not an image id"),
    ],
)
def test_malformed_image_id_in_chat_says_so_naming_the_url_field(client, url, words) -> None:
    err = assert_error(_chat_image(client, url), 400, words, "invalid_image_id")
    assert err["param"] == "messages[0].content[0].image_url.url"
    assert err["message"].startswith("messages[0].content[0].image_url.url: unknown image id")
    if not words.startswith("that is"):  # a wrong kind is named; a malformed id gets the form
        assert "img- followed by 32 lowercase hex digits" in err["message"]
    # the string form of image_url names image_url itself
    err = assert_error(_chat_image(client, url, as_object=False), 400, words, "invalid_image_id")
    assert err["param"] == "messages[0].content[0].image_url"


def test_unknown_and_other_urls_keep_their_own_errors(client) -> None:
    err = assert_error(_chat_image(client, "img-" + HEX32), 400, "unknown image id")
    assert err["code"] == "image_not_found" and "malformed" not in err["message"]
    err = assert_error(_chat_image(client, "ftp://host/cat.png"), 400, "unsupported image url")
    assert err["code"] == "unsupported_image_url"
    assert err["param"] == "messages[0].content[0].image_url.url"
    assert _chat_image(client, client.image_id).status_code == 200
    assert _chat_image(client, f"mmserve://images/{client.image_id}").status_code == 200


def test_long_malformed_id_is_not_echoed_whole(client) -> None:
    err = assert_error(_chat_image(client, "img-" + "x" * 5000), 400, "malformed")
    assert len(err["message"]) < 400 and "x" * 81 not in err["message"]


@pytest.mark.parametrize(
    "url, words, code",
    [
        ("vid-00", "malformed", "invalid_video_id"),
        ("vid", "malformed", "invalid_video_id"),
        ("img-" + HEX32, "that is an image id, not a video id", "invalid_video_id"),
        ("vid-" + HEX32, "unknown video id", "video_not_found"),
    ],
)
def test_video_ids_in_chat(client, url, words, code) -> None:
    msgs = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}]}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
    err = assert_error(r, 400, words, code)
    assert err["param"] == "messages[0].content[0].video_url"


def test_malformed_image_id_in_responses_input(client) -> None:
    body = {
        "input": [
            {
                "role": "user",
                "content": [{"type": "input_image", "image_url": "img-deadbeef"}],
            }
        ],
        "max_output_tokens": 1,
    }
    err = assert_error(
        client.post("/v1/responses", json=body), 400, "malformed", "invalid_image_id"
    )
    assert err["param"] == "input[0].content[0].image_url"


@pytest.mark.parametrize(
    "method, path, param, code",
    [
        ("get", "/v1/images/img-deadbeef", "image_id", "invalid_image_id"),
        ("delete", "/v1/images/nope", "image_id", "invalid_image_id"),
        ("get", "/v1/videos/vid-1", "video_id", "invalid_video_id"),
        ("delete", f"/v1/videos/img-{HEX32}", "video_id", "invalid_video_id"),
        ("get", "/v1/files/nope", "file_id", "invalid_file_id"),
        ("get", "/v1/files/file-xyz/content", "file_id", "invalid_file_id"),
        ("delete", "/v1/files/FILE-0", "file_id", "invalid_file_id"),
        ("get", "/v1/batches/batch_1", "batch_id", "invalid_batch_id"),
        ("post", "/v1/batches/nope/cancel", "batch_id", "invalid_batch_id"),
        ("get", f"/v1/images/img-{HEX32}", "image_id", "image_not_found"),
        ("get", f"/v1/files/file-{HEX32[:24]}", "file_id", "file_not_found"),
        ("get", f"/v1/batches/batch_{HEX32[:24]}", "batch_id", "batch_not_found"),
    ],
)
def test_ids_in_paths_are_404s_that_say_malformed_or_unknown(
    client,
    method,
    path,
    param,
    code,
) -> None:
    err = assert_error(getattr(client, method)(path), 404, f"no {param[:-3]} with id", code)
    assert err["param"] == param and err["type"] == "not_found_error"
    assert ("malformed" in err["message"] or "that is" in err["message"]) == code.startswith(
        "invalid_"
    )


def test_ask_about_a_malformed_image_id_is_a_404(client) -> None:
    r = client.post("/v1/images/img-deadbeef/ask", json={"questions": ["hi"]})
    assert_error(r, 404, "malformed", "invalid_image_id")


def test_batch_input_file_id_malformed_400_unknown_404(client) -> None:
    body = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
    r = client.post("/v1/batches", json={**body, "input_file_id": "file-nope"})
    err = assert_error(r, 400, "malformed", "invalid_file_id")
    assert err["param"] == "input_file_id"
    r = client.post("/v1/batches", json={**body, "input_file_id": "file-" + HEX32[:24]})
    err = assert_error(r, 404, "no file with id", "file_not_found")
    assert err["param"] == "input_file_id"
    assert client.get("/v1/batches").json()["data"] == []


# ---- 2. a client gone mid-body -----------------------------------------------------------
def _multipart(name: str, data: bytes, extra: dict[str, str] | None = None) -> tuple[str, bytes]:
    b = "faultboundary"
    body = b""
    for k, v in (extra or {}).items():
        body += f'--{b}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
    body += (
        (
            f'--{b}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{b}--\r\n".encode()
    )
    return f"multipart/form-data; boundary={b}", body


async def _cut_short(app, path: str, ctype: str, body: bytes) -> list[dict]:
    """POST ``body`` to ``app`` announcing its full length, send a third of it, then
    disconnect (as uvicorn reports a client that closed early). Returns what was sent."""
    sent: list[dict] = []
    chunks = [{"type": "http.request", "body": body[: len(body) // 3], "more_body": True}]

    async def receive() -> dict:
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        sent.append(msg)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", ctype.encode()),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    await app(scope, receive, send)
    return sent


def test_client_gone_mid_body_leaves_one_log_line_and_no_state(client, photos, caplog) -> None:
    big = max(photos.values(), key=len)  # a body big enough to cut in three
    chat_body = {"model": MODEL, "messages": user(None, "Describe " + "it " * 300), "max_tokens": 2}
    cases = [
        ("/v1/images", *_multipart("a.png", big)),
        ("/v1/images", "application/json", json.dumps({"data": "QUJD" * 3000}).encode()),
        ("/v1/videos", *_multipart("a.mp4", big)),
        ("/v1/chat/completions", "application/json", json.dumps(chat_body).encode()),
        (
            "/v1/responses",
            "application/json",
            json.dumps({"input": "x" * 3000, "max_output_tokens": 2}).encode(),
        ),
        ("/v1/files", *_multipart("b.jsonl", b'{"a": 1}\n' * 2000, {"purpose": "batch"})),
        (
            "/v1/batches",
            "application/json",
            json.dumps(
                {"input_file_id": "file-" + HEX32[:24], "metadata": {"a": "b" * 500}}
            ).encode(),
        ),
        (
            f"/v1/images/{client.image_id}/ask",
            "application/json",
            json.dumps({"questions": ["q" * 1000] * 3}).encode(),
        ),
        (f"/v1/videos/vid-{HEX32}/qa", "application/json", json.dumps(chat_body).encode()),
    ]
    st = client.app.state.mm
    before = (len(st.store), len(st.videos), client.get("/v1/files").json()["data"])
    caplog.set_level(logging.DEBUG)
    for path, ctype, body in cases:
        caplog.clear()
        sent = client.portal.call(_cut_short, client.app, path, ctype, body)
        statuses = [m["status"] for m in sent if m["type"] == "http.response.start"]
        assert statuses in ([], [499]), (path, statuses)
        bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
        assert bad == [], (path, [r.getMessage() for r in bad])
        lines = [r.getMessage() for r in caplog.records if "disconnected" in r.getMessage()]
        assert lines == [f"client disconnected while sending the body of POST {path}"], path
    after = (len(st.store), len(st.videos), client.get("/v1/files").json()["data"])
    assert after == before
    assert client.get("/v1/batches").json()["data"] == []
    assert st.client.queued == 0 and st.client.online == 0
    assert_healthy(client)


# ---- 3. stop bounds ----------------------------------------------------------------------
def test_stop_is_bounded_in_count_and_length(client) -> None:
    def ask(stop) -> object:
        return chat(client, [{"type": "text", "text": "Hi"}], max_tokens=2, stop=stop)

    assert ask(["a", "b", "c", "d"][:MAX_STOP]).status_code == 200
    err = assert_error(ask(["a", "b", "c", "d", "e"]), 400, f"the limit is {MAX_STOP}")
    assert err["param"] == "stop"
    assert ask("s" * MAX_STOP_CHARS).status_code == 200
    err = assert_error(ask("s" * (MAX_STOP_CHARS + 1)), 400, f"at most {MAX_STOP_CHARS}")
    assert err["param"] == "stop"
    err = assert_error(ask(["ok", "s" * (MAX_STOP_CHARS + 1)]), 400, f"at most {MAX_STOP_CHARS}")
    assert err["param"] == "stop[1]"
    # the other routes with sampling fields share the rule
    r = client.post(
        f"/v1/images/{client.image_id}/ask",
        json={"questions": ["hi"], "stop": list("abcdef"), "max_tokens": 1},
    )
    assert assert_error(r, 400, "the limit is 4")["param"] == "stop"
    assert_healthy(client)


# ---- 4. tool fields on /v1/responses -----------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [
        ("parallel_tool_calls", False),
        ("parallel_tool_calls", 1),
        ("tool_choice", "auto"),
        ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "name": "f"}),
        ("max_tool_calls", 2),
        ("tools", [{"type": "function", "name": "f", "parameters": {}}]),
    ],
)
def test_responses_refuses_tool_fields_without_tools(client, field, value) -> None:
    body = {"input": "Hi", "max_output_tokens": 1, field: value}
    err = assert_error(client.post("/v1/responses", json=body), 400, field)
    assert err["param"] == field


def test_responses_accepts_tool_fields_that_ask_for_nothing(client) -> None:
    for extra in ({"tool_choice": "none"}, {"parallel_tool_calls": True}, {"tools": []}):
        r = client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 1, **extra})
        assert r.status_code == 200, (extra, r.text)
        out = r.json()
        assert out["object"] == "response" and out["usage"]["output_tokens"] == 1


def test_chat_refuses_tool_fields_without_tools_the_same_way(client) -> None:
    for field, value in (("parallel_tool_calls", False), ("tool_choice", "auto")):
        r = chat(client, [{"type": "text", "text": "Hi"}], max_tokens=1, **{field: value})
        err = assert_error(r, 400, f"{field} needs tools")
        assert err["param"] == field


# ---- 5. messages that name what was wrong ------------------------------------------------
@pytest.mark.parametrize(
    "path, body, param, words",
    [
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
            "expected a string or an array",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stop": 5},
            "stop",
            "expected a string or an array",
        ),
        ("/v1/responses", {"model": MODEL, "input": 5}, "input", "expected a string or an array"),
    ],
)
def test_a_value_no_union_branch_takes_names_every_branch(
    client, path: str, body: dict, param: str, words: str
) -> None:
    err = assert_error(client.post(path, json=body), 400, words)
    assert err["param"] == param


def test_a_wrong_charset_is_named(client) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    r = client.post(
        "/v1/chat/completions",
        content=body.encode("latin-1"),
        headers={"Content-Type": "application/json; charset=latin-1"},
    )
    assert_error(r, 400, "charset=latin-1")


def test_a_file_upload_without_purpose_says_field_required(client) -> None:
    r = client.post("/v1/files", files={"file": ("b.jsonl", b"{}\n")})
    err = assert_error(r, 400, "purpose: field required")
    assert err["param"] == "purpose"
