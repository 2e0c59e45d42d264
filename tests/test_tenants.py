"""Tenants (issue 42): ``--api-keys FILE``, one key per tenant; each tenant's cache is
salted with it (unless ``--shared-cache``) and its uploads, files and batches are its own."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from PIL import Image

from api.app import ServerSettings, create_app
from api.auth import APIKeyMiddleware, TenantMiddleware
from api.tenants import TenantFileError, TenantKeys, current_tenant, parse_keys
from tests.helpers import MODEL, data_url, image_part, png_bytes, tower_runs
from tests.videos import encode_mp4, rgb_frames

KEYS = "# tenants\nkey-alice-0001 alice\n\n  key-bob-000002   bob\n"
A = {"Authorization": "Bearer key-alice-0001"}
B = {"Authorization": "Bearer key-bob-000002"}


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_total_tokens=8192)


def _settings(tmp_path: Path, **kw) -> ServerSettings:
    keys = tmp_path / "keys.txt"
    if not keys.exists():
        keys.write_text(KEYS)
    return ServerSettings(
        served_model_name=MODEL,
        api_keys=str(keys),
        data_dir=str(tmp_path / "data"),
        image_store_dir=str(tmp_path / "images"),
        **kw,
    )


@pytest.fixture()
def client(engine, tmp_path):
    engine.flush_cache()
    with TestClient(create_app(engine, _settings(tmp_path))) as c:
        yield c


def _photo(seed: int) -> bytes:
    return png_bytes(Image.new("RGB", (44, 36), (seed * 53 % 256, seed * 7 % 256, 99)))


def _chat(c, headers, content, **kw) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    r = c.post(
        "/v1/chat/completions",
        json={**body, "max_tokens": 2, "temperature": 0, **kw},
        headers=headers,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


# ---- the keys file ------------------------------------------------------------------


def test_parse_keys_skips_comments_and_blank_lines() -> None:
    assert parse_keys("# c\n\n  k-12345678 t1\nk-87654321 t2\n") == {
        "k-12345678": "t1",
        "k-87654321": "t2",
    }


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("k-12345678 t1\nk-2345678 t2 extra\n", 2, "expected 'KEY TENANT'"),
        ("# c\nonlykey\n", 2, "expected 'KEY TENANT'"),
        ("short t1\n", 1, "shorter than"),
        ("k-12345678 bad/name\n", 1, "tenant"),
        ("k-12345678 t1\nk-12345678 t2\n", 2, "already given"),
    ],
)
def test_malformed_line_is_refused_naming_it(text, line, words) -> None:
    with pytest.raises(TenantFileError, match=f"line {line}: .*{words}"):
        parse_keys(text)
    with pytest.raises(TenantFileError, match="no 'KEY TENANT' line"):
        parse_keys("# nothing\n")


def test_a_bad_file_refuses_to_start(engine, tmp_path) -> None:
    (tmp_path / "keys.txt").write_text("key-alice-0001 alice\nbroken\n")
    with pytest.raises(ValueError, match="line 2"):
        create_app(engine, _settings(tmp_path))


def test_lookup_and_reload_keep_old_keys_on_a_bad_file(tmp_path, caplog) -> None:
    path = tmp_path / "k.txt"
    path.write_text("key-one-0001 one\n")
    keys = TenantKeys.from_file(path)
    assert keys.lookup(b"key-one-0001") == "one" and keys.lookup(b"key-one-0002") is None
    path.write_text("key-two-0002 two\n")
    assert keys.reload() and keys.lookup(b"key-two-0002") == "two"
    assert keys.lookup(b"key-one-0001") is None
    path.write_text("garbage line here\n")
    caplog.clear()
    assert not keys.reload()
    assert keys.lookup(b"key-two-0002") == "two"  # the old keys stay
    lines = [r for r in caplog.records if "not reloaded" in r.getMessage()]
    assert len(lines) == 1 and "line 1" in lines[0].getMessage()


# ---- requests -------------------------------------------------------------------------


def test_keys_name_tenants_and_wrong_keys_are_401(client) -> None:
    assert client.get("/v1/models", headers=A).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/v1/models").status_code == 401
    metrics = client.get("/metrics", headers=A).text
    assert "mmserve_tenants 2.0" in metrics
    assert "alice" not in metrics and "bob" not in metrics


def test_tenants_share_no_cache_unless_shared(client, engine, tmp_path) -> None:
    url = data_url(_photo(1))
    content = [image_part(url), {"type": "text", "text": "What is it?"}]
    _chat(client, A, content)
    runs = tower_runs(client, A)
    bob = _chat(client, B, content)
    assert _cached(bob) == 0 and tower_runs(client, A) == runs + 1
    assert _cached(_chat(client, A, content)) > 0
    # bob sending alice's tenant name as his salt is still bob's namespace
    assert _cached(_chat(client, B, content, cache_salt="alice")) == 0


def test_shared_cache_shares(engine, tmp_path) -> None:
    engine.flush_cache()
    with TestClient(create_app(engine, _settings(tmp_path, shared_cache=True))) as c:
        content = [image_part(data_url(_photo(2))), {"type": "text", "text": "What is it?"}]
        _chat(c, A, content)
        assert _cached(_chat(c, B, content)) > 0


def test_images_belong_to_their_tenant(client) -> None:
    data = _photo(3)
    files = {"file": ("x.png", data, "application/octet-stream")}
    a = client.post("/v1/images", files=files, headers=A).json()
    iid = a["id"]
    assert client.get(f"/v1/images/{iid}", headers=B).status_code == 404
    assert client.get(f"/v1/images/{iid}/thumbnail", headers=B).status_code == 404
    assert client.get(f"/v1/images/{iid}/thumbnail", headers=A).status_code == 200
    assert client.get("/v1/images", headers=B).json()["data"] == []
    assert [i["id"] for i in client.get("/v1/images", headers=A).json()["data"]] == [iid]
    r = client.post(
        f"/v1/images/{iid}/ask", json={"questions": ["What?"], "max_tokens": 1}, headers=B
    )
    assert r.status_code == 404
    # bob's chat may not name alice's upload
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "max_tokens": 1,
            "messages": [
                {"role": "user", "content": [image_part(iid), {"type": "text", "text": "hi"}]}
            ],
        },
        headers=B,
    )
    assert r.status_code == 400 and iid in r.text
    # the same bytes from bob: his own entry, created now (nothing says alice had them)
    time.sleep(0.01)
    b = client.post("/v1/images", files=files, headers=B).json()
    assert b["created_at"] >= a["created_at"]
    assert b["id"] == iid  # content-addressed within a tenant: bob could hash the bytes too
    assert client.delete(f"/v1/images/{iid}", headers=B).status_code == 200  # his own copy
    assert client.get(f"/v1/images/{iid}", headers=B).status_code == 404
    assert client.get(f"/v1/images/{iid}", headers=A).status_code == 200  # alice's stays


def test_videos_belong_to_their_tenant(client) -> None:
    data = encode_mp4(rgb_frames(6, seed=5), fps=6)
    files = {"file": ("v.mp4", data, "video/mp4")}
    vid = client.post("/v1/videos", files=files, headers=A).json()["id"]
    assert client.get(f"/v1/videos/{vid}", headers=B).status_code == 404
    assert client.get(f"/v1/videos/{vid}/thumbnail", headers=B).status_code == 404
    assert client.get("/v1/videos", headers=B).json()["data"] == []
    assert (
        client.post(f"/v1/videos/{vid}/qa", json={"questions": ["?"]}, headers=B).status_code == 404
    )
    assert client.delete(f"/v1/videos/{vid}", headers=B).status_code == 404
    assert [v["id"] for v in client.get("/v1/videos", headers=A).json()["data"]] == [vid]


def test_files_and_batches_belong_to_their_tenant(client) -> None:
    line = {
        "custom_id": "c1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "max_tokens": 2,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}],
        },
    }
    f = client.post(
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", json.dumps(line))},
        headers=A,
    ).json()
    fid = f["id"]
    assert client.get(f"/v1/files/{fid}", headers=B).status_code == 404
    assert client.get(f"/v1/files/{fid}/content", headers=B).status_code == 404
    assert client.get("/v1/files", headers=B).json()["data"] == []
    body = {"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    assert client.post("/v1/batches", json=body, headers=B).status_code in (400, 404)
    bid = client.post("/v1/batches", json=body, headers=A).json()["id"]
    assert client.get(f"/v1/batches/{bid}", headers=B).status_code == 404
    assert client.get("/v1/batches", headers=B).json()["data"] == []
    assert client.post(f"/v1/batches/{bid}/cancel", headers=B).status_code == 404
    deadline = time.time() + 60
    while (b := client.get(f"/v1/batches/{bid}", headers=A).json())["status"] != "completed":
        assert time.time() < deadline, b
        time.sleep(0.05)
    out = b["output_file_id"]
    assert client.get(f"/v1/files/{out}/content", headers=B).status_code == 404
    rec = json.loads(client.get(f"/v1/files/{out}/content", headers=A).text.splitlines()[0])
    assert rec["response"]["status_code"] == 200
    assert client.delete(f"/v1/files/{fid}", headers=B).status_code == 404
    assert [x["id"] for x in client.get("/v1/batches", headers=A).json()["data"]] == [bid]


def test_one_key_is_the_default_tenant(engine) -> None:
    with TestClient(create_app(engine, ServerSettings(served_model_name=MODEL, api_key="k1"))) as c:
        h = {"Authorization": "Bearer k1"}
        assert c.get("/v1/models", headers=h).status_code == 200
        assert "mmserve_tenants 1.0" in c.get("/metrics", headers=h).text


def test_vision_files_belong_to_their_tenant(client) -> None:
    files = {"file": ("cat.png", _photo(9), "image/png")}
    f = client.post("/v1/files", data={"purpose": "vision"}, files=files, headers=A)
    assert f.status_code == 200, f.text
    fid = f.json()["id"]
    assert client.get(f"/v1/files/{fid}", headers=B).status_code == 404
    assert fid not in [x["id"] for x in client.get("/v1/files", headers=B).json()["data"]]
    assert fid in [x["id"] for x in client.get("/v1/files", headers=A).json()["data"]]
    assert client.delete(f"/v1/files/{fid}", headers=B).status_code == 404
    assert client.get(f"/v1/files/{fid}", headers=A).status_code == 200


def test_request_state_carries_the_tenant(tmp_path) -> None:
    """``request.state.tenant`` (what stored responses record as their owner) and the
    context variable, for a key of the file, for one key, and without keys."""

    def app_with(middleware, **kw) -> TestClient:
        app = FastAPI()

        @app.get("/who")
        def who(request: Request) -> dict:
            return {"state": request.state.tenant, "var": current_tenant()}

        app.add_middleware(middleware, **kw)
        return TestClient(app)

    path = tmp_path / "k.txt"
    path.write_text(KEYS)
    with app_with(APIKeyMiddleware, keys=TenantKeys.from_file(path)) as c:
        assert c.get("/who", headers=B).json() == {"state": "bob", "var": "bob"}
    with app_with(APIKeyMiddleware, api_key="only-key") as c:
        got = c.get("/who", headers={"Authorization": "Bearer only-key"}).json()
        assert got == {"state": "default", "var": "default"}
    with app_with(TenantMiddleware) as c:
        assert c.get("/who").json() == {"state": "default", "var": "default"}
