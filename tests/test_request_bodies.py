"""Every POST route answers a body that does not parse with a 400 and a JSON error.

One parser (:mod:`api.json_body`) serves every route that reads JSON, so each kind of
broken body (deep nesting of arrays or objects, invalid JSON or UTF-8, empty, not an
object, wrong types, NaN/Infinity/huge numbers, duplicate keys, unpaired surrogates,
JSON sent as multipart and the reverse) is tried on every route, on the
single-process app and on the replica ingress.
"""

from __future__ import annotations

import base64
import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from api.app import ServerSettings, create_app
from api.json_body import MAX_INT_DIGITS, JSONBodyRoute, json_media_type, parse_json_object
from tests.helpers import assert_healthy

MODEL = "llava-tiny"
IMG = "img-" + "0" * 32
VID = "vid-" + "0" * 32
JSON = "application/json"
#: every POST route; ask/qa name an unknown id: the body is refused before the id is looked up
ROUTES = [
    "/v1/chat/completions",
    "/v1/images",
    "/v1/videos",
    f"/v1/images/{IMG}/ask",
    f"/v1/videos/{VID}/qa",
    "/v1/cache/flush",
]
MULTIPART = b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="a.png"\r\n\r\n'
MULTIPART += b"\x89PNG not really\r\n--xyz--\r\n"


def _deep(n: int, open_: bytes, close: bytes, inner: bytes = b"1") -> bytes:
    return open_ * n + inner + close * n


#: name -> (body, content type, words the message must hold)
BAD_BODIES: dict[str, tuple[bytes, str | None, str]] = {
    "arrays 2,000 deep": (_deep(2000, b"[", b"]"), JSON, "nested deeper"),
    "arrays 100,000 deep": (_deep(100_000, b"[", b"]"), JSON, "nested deeper"),
    "objects 2,000 deep": (_deep(2000, b'{"a":', b"}"), JSON, "nested deeper"),
    "objects 100,000 deep": (_deep(100_000, b'{"a":', b"}"), JSON, "nested deeper"),
    "a field 100,000 deep": (b'{"messages":' + _deep(100_000, b"[", b"]") + b"}", JSON, "deeper"),
    "mixed 500 deep": (b'{"x":' + _deep(250, b'[{"a":', b"}]") + b"}", JSON, "nested deeper"),
    "65 deep": (_deep(64, b'{"a":', b"}", b"[]"), JSON, "nested deeper than 64"),
    "unclosed": (b'{"model": "x"', JSON, "not valid JSON"),
    "not json": (b"{not json", JSON, "not valid JSON"),
    "trailing comma": (b'{"a": 1,}', JSON, "not valid JSON"),
    "single quotes": (b"{'a': 1}", JSON, "not valid JSON"),
    "two objects": (b"{} {}", JSON, "not valid JSON"),
    "utf-8 bom": (b"\xef\xbb\xbf{}", JSON, "not valid JSON"),
    "invalid utf-8": (b'{"model": "\xff\xfe"}', JSON, "UTF-8"),
    "utf-16": ('{"model": "x"}'.encode("utf-16"), JSON, "UTF-8"),
    "latin-1 charset": (b'{"model": "x"}', JSON + "; charset=latin-1", "Content-Type"),
    "unpaired surrogate": (b'{"model": "\\ud800"}', JSON, "surrogate"),
    "surrogate key": (b'{"\\udc00": 1}', JSON, "surrogate"),
    "empty": (b"", JSON, "empty"),
    "whitespace": (b" \r\n\t", JSON, "empty"),
    "null": (b"null", JSON, "JSON object"),
    "array": (b"[]", JSON, "JSON object"),
    "string": (b'"text"', JSON, "JSON object"),
    "number": (b"1", JSON, "JSON object"),
    "NaN top level": (b"NaN", JSON, "JSON object"),
    "wrong types": (
        b'{"messages": 1, "questions": 1, "data": 1, "max_tokens": "x"}',
        JSON,
        "",
    ),
    "NaN": (b'{"temperature": NaN}', JSON, "temperature: NaN is not a JSON number"),
    "Infinity": (b'{"temperature": Infinity}', JSON, "Infinity is not a JSON number"),
    "-Infinity": (b'{"max_tokens": -Infinity}', JSON, "-Infinity is not a JSON number"),
    "1e999": (b'{"max_tokens": 1e999}', JSON, "max_tokens: number is too large"),
    "-1e400 in a list": (b'{"a": [1, -1e400]}', JSON, "a[1]: number is too large"),
    "5000 digits": (b'{"seed": ' + b"9" * 5000 + b"}", JSON, "seed: integer of 5000 digits"),
    "duplicate key": (b'{"model": "a", "model": "b"}', JSON, "model: duplicate key"),
    "nested duplicate": (b'{"x": [{"k": 1, "k": 2}]}', JSON, "x[0].k: duplicate key"),
    "json as multipart": (b'{"data": "AAAA"}', "multipart/form-data; boundary=xyz", ""),
    "json as multipart, no boundary": (b'{"data": "AAAA"}', "multipart/form-data", ""),
    "multipart as json": (MULTIPART, JSON, "not valid"),
}
#: content types that are neither JSON nor multipart: 400 on the JSON routes; the
#: upload routes answer 415 (they take two content types and name both)
OTHER_TYPES: dict[str, tuple[bytes, str | None]] = {
    "json as text/plain": (b'{"questions": ["q"]}', "text/plain"),
    "json without content type": (b'{"questions": ["q"]}', None),
    "json as a form": (b"questions=q", "application/x-www-form-urlencoded"),
}
UPLOADS = {"/v1/images", "/v1/videos"}


@pytest.fixture(scope="module")
def client(make_engine):
    engine = make_engine(max_total_tokens=4096)
    with TestClient(create_app(engine, ServerSettings(served_model_name=MODEL))) as c:
        yield c


def post(client, route: str, body: bytes, ctype: str | None):
    headers = {"content-type": ctype} if ctype else {}
    return client.post(route, content=body, headers=headers)


def assert_400(r, words: str = "") -> dict:
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"], err
    assert words in err["message"], err
    assert "Traceback" not in err["message"] and "/site-packages/" not in err["message"]
    return err


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", list(BAD_BODIES))
def test_bad_bodies_are_400_on_every_post_route(client, route, kind) -> None:
    body, ctype, words = BAD_BODIES[kind]
    if route == "/v1/cache/flush":
        if not body.strip():  # it takes no body: an empty one is right
            assert post(client, route, body, ctype).status_code == 200
            return
        words = "no request body"
    elif route in UPLOADS and kind == "wrong types":
        words = "unknown field"
    err = assert_400(post(client, route, body, ctype), words)
    if ": " in words:  # a bad number or a duplicate key: param names the field
        assert err["param"] == words.split(":")[0], err


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", list(OTHER_TYPES))
def test_other_content_types(client, route, kind) -> None:
    body, ctype = OTHER_TYPES[kind]
    r = post(client, route, body, ctype)
    if route in UPLOADS:
        assert r.status_code == 415, r.text
        assert "multipart/form-data" in r.json()["error"]["message"]
    elif route == "/v1/cache/flush":
        assert_400(r, "no request body")
    else:
        assert_400(r, "Content-Type: application/json")


def test_the_server_is_fine_afterwards(client, photos) -> None:
    for kind in ("arrays 100,000 deep", "objects 100,000 deep", "duplicate key"):
        body, ctype, _ = BAD_BODIES[kind]
        assert_400(post(client, "/v1/chat/completions", body, ctype))
    assert_healthy(client)
    # good bodies still work: +json media types, charset utf-8, the deepest allowed
    ok = json.dumps(
        {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    )
    for ctype in (JSON, "application/json; charset=UTF-8", "application/vnd.api+json"):
        r = post(client, "/v1/chat/completions", ok.encode(), ctype)
        assert r.status_code == 200, r.text
    r = client.post("/v1/images", json={"data": base64.b64encode(photos["cat.png"]).decode()})
    assert r.status_code == 200, r.text
    # a field the server would not act on
    r = client.post("/v1/images", json={"data": "AAAA", "caption": "a cat"})
    assert assert_400(r, "caption: unknown field")["param"] == "caption"
    assert client.post("/v1/cache/flush").status_code == 200
    assert client.post("/v1/cache/flush", content=b"  ").status_code == 200


def test_depth_bound_is_a_setting(make_engine) -> None:
    engine = make_engine(max_total_tokens=4096)
    settings_ = ServerSettings(served_model_name=MODEL, max_json_depth=4)
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(create_app(engine, settings_)) as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200  # depth 3
        body["messages"][0]["content"] = [{"type": "text", "text": "hi"}]  # depth 5
        err = assert_400(c.post("/v1/chat/completions", json=body), "nested deeper than 4")
        assert err["param"] == "messages"
    for bad in (0, 513):
        with pytest.raises(ValueError, match="max_json_depth"):
            ServerSettings(max_json_depth=bad).validate()


# ---- the parser on its own --------------------------------------------------------------

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(), _json, max_size=5))
def test_valid_objects_parse_as_the_standard_library_does(obj) -> None:
    raw = json.dumps(obj, ensure_ascii=False).encode()
    assert parse_json_object(raw, max_depth=10_000) == json.loads(raw)


def _true_depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_true_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_true_depth, value), default=0)
    return 0


_tricky_text = st.text(alphabet='[]{}"\\ab,:')


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        _tricky_text,
        st.recursive(
            st.integers() | _tricky_text,
            lambda inner: (
                st.lists(inner, max_size=3) | st.dictionaries(_tricky_text, inner, max_size=3)
            ),
            max_leaves=40,
        ),
        max_size=4,
    ),
    st.integers(1, 8),
)
def test_depth_limit_matches_the_real_depth(obj, limit) -> None:
    """Brackets, quotes and backslashes inside strings never count as nesting."""
    raw = json.dumps(obj).encode()
    if _true_depth(obj) <= limit:
        assert parse_json_object(raw, limit) == obj
    else:
        with pytest.raises(Exception) as e:
            parse_json_object(raw, limit)
        assert e.value.status == 400 and f"deeper than {limit}" in e.value.message


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 3000), st.sampled_from([(b"[", b"]"), (b'{"k":', b"}")]))
def test_depth_is_counted_exactly(n, pair) -> None:
    raw = b'{"k":' + _deep(n, *pair) + b"}"  # n + 1 levels
    limit = 200
    if n + 1 <= limit:
        assert parse_json_object(raw, limit)
    else:
        with pytest.raises(Exception) as e:
            parse_json_object(raw, limit)
        assert e.value.status == 400 and "nested deeper than 200" in e.value.message


@given(st.integers(-(10**MAX_INT_DIGITS) + 1, 10**MAX_INT_DIGITS - 1))
def test_integers_up_to_the_digit_bound_are_kept(n) -> None:
    assert parse_json_object(json.dumps({"n": n}).encode()) == {"n": n}


@pytest.mark.parametrize(
    "ctype, ok",
    [
        ("application/json", True),
        ("Application/JSON; charset=utf-8", True),
        ('application/json; charset="UTF-8"', True),
        ("application/problem+json", True),
        ("application/json; charset=utf-16", False),
        ("text/json", False),
        ("multipart/form-data; boundary=x", False),
        ("", False),
        (None, False),
    ],
)
def test_json_media_types(ctype, ok) -> None:
    assert json_media_type(ctype) is ok


# ---- the replica ingress uses the same parser -------------------------------------------


def test_replica_ingress_uses_the_same_parser(model_dir) -> None:
    pytest.importorskip("ray.serve", reason='needs Ray Serve: pip install -e ".[replicas]"')
    from fastapi.routing import APIRoute

    from api.replicas.ingress import create_ingress_app
    from mmserve.config import EngineConfig
    from mmserve.frontend.frontend import FrontEnd, load_frontend_model

    front = FrontEnd(EngineConfig(model_path=str(model_dir)), load_frontend_model(model_dir))
    app = create_ingress_app(front, object(), ServerSettings(), MODEL, 1)  # type: ignore[arg-type]

    def routes(items):  # included routers nest their routes
        for r in items:
            sub = getattr(r, "original_router", None)
            yield from routes(sub.routes) if sub is not None else [r]

    posts = [r for r in routes(app.routes) if isinstance(r, APIRoute) and "POST" in r.methods]
    assert {r.path for r in posts} >= {
        "/v1/chat/completions",
        "/v1/images",
        "/v1/videos",
        "/v1/images/{image_id}/ask",
        "/v1/videos/{video_id}/qa",
        "/v1/cache/flush",
    }
    assert all(isinstance(r, JSONBodyRoute) for r in posts)
    with TestClient(app) as c:
        for route in ROUTES:
            for kind in ("arrays 100,000 deep", "objects 2,000 deep", "duplicate key", "empty"):
                body, ctype, _ = BAD_BODIES[kind]
                if route != "/v1/cache/flush" or body.strip():  # flush takes no body
                    assert_400(post(c, route, body, ctype))
