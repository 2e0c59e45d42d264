"""Remote URLs and local paths only when the operator allows them; API key from the environment;
every ``serve`` server flag reaches the app's settings."""

from __future__ import annotations

import http.server
import threading

import pytest
from fastapi.testclient import TestClient

from api.app import ServerSettings, create_app
from api.cli import build_parser, settings_from_args
from api.settings import API_KEY_ENV
from tests.helpers import MODEL, SAMPLES, chat, image_part


def ask(client, url: str):
    return chat(client, [image_part(url), {"type": "text", "text": "?"}], max_tokens=2)


@pytest.fixture(scope="module")
def http_server():
    """Serves tests/../samples/images on 127.0.0.1."""
    root = SAMPLES

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *args) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_remote_urls_only_when_allowed(make_engine, http_server, photos) -> None:
    engine = make_engine(max_total_tokens=4096)
    url = f"{http_server}/cat.png"
    with TestClient(create_app(engine, ServerSettings(served_model_name=MODEL))) as c:
        r = ask(c, url)
        assert r.status_code == 400
        assert "--allow-remote-images" in r.json()["error"]["message"]
    allowed = ServerSettings(served_model_name=MODEL, allow_remote_images=True)
    with TestClient(create_app(engine, allowed)) as c:  # loopback is not public
        err = ask(c, url).json()["error"]
        assert err["code"] == "image_url_not_allowed", err
    allowed.remote_image_allowed_networks = "127.0.0.0/8"
    with TestClient(create_app(engine, allowed)) as c:
        r = ask(c, url)
        assert r.status_code == 200, r.text
        upload = c.post("/v1/images", files={"file": ("c.png", photos["cat.png"])}).json()
        again = ask(c, upload["id"]).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 576  # same pixels
        r = ask(c, f"{http_server}/missing.png")
        assert r.status_code == 400 and "could not fetch" in r.json()["error"]["message"]


def test_local_files_only_inside_the_allowed_directory(make_engine, tmp_path, photos) -> None:
    engine = make_engine(max_total_tokens=4096)
    media = tmp_path / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(photos["cat.png"])
    (tmp_path / "secret.png").write_bytes(photos["cat.png"])
    with TestClient(create_app(engine, ServerSettings(served_model_name=MODEL))) as c:
        r = ask(c, f"file://{media}/cat.png")
        assert r.status_code == 400
        assert "--allowed-local-media-path" in r.json()["error"]["message"]
    settings = ServerSettings(served_model_name=MODEL, allowed_local_media_path=str(media))
    with TestClient(create_app(engine, settings)) as c:
        assert ask(c, f"file://{media}/cat.png").status_code == 200
        for bad in (f"file://{tmp_path}/secret.png", f"file://{media}/../secret.png"):
            r = ask(c, bad)
            assert r.status_code == 400 and "not a file inside" in r.json()["error"]["message"]


def test_api_key_from_the_environment(make_engine, monkeypatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "env-key")
    engine = make_engine(max_total_tokens=2048)
    with TestClient(create_app(engine, ServerSettings(served_model_name=MODEL))) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/v1/models").status_code == 401
        r = c.get("/v1/models", headers={"Authorization": "Bearer env-key"})
        assert r.status_code == 200
        r = c.get("/v1/models", headers={"Authorization": "bearer env-key"})
        assert r.status_code == 200  # the scheme name is case-insensitive
        for bad in ("Bearer env-keyx", "Basic env-key", "env-key", "Bearer"):
            assert c.get("/v1/models", headers={"Authorization": bad}).status_code == 401
    # an explicit empty key turns the check off even with the variable set
    with TestClient(create_app(engine, ServerSettings(api_key=""))) as c:
        assert c.get("/v1/models").status_code == 200


def test_serve_flags_reach_the_settings(tmp_path) -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--api-key",
            "k",
            "--max-queued-requests",
            "7",
            "--max-request-bytes",
            "1000",
            "--max-image-bytes",
            "500",
            "--max-images-per-request",
            "3",
            "--max-stored-images",
            "9",
            "--max-stored-image-bytes",
            "12345",
            "--image-store-dir",
            str(tmp_path),
            "--allow-remote-images",
            "--allowed-local-media-path",
            str(tmp_path),
            "--served-model-name",
            "m",
        ]
    )
    _, engine, server = settings_from_args(args)
    assert server == ServerSettings(
        served_model_name="m",
        api_key="k",
        max_queued_requests=7,
        max_request_bytes=1000,
        max_stored_images=9,
        max_stored_image_bytes=12345,
        image_store_dir=str(tmp_path),
        allow_remote_images=True,
        allowed_local_media_path=str(tmp_path),
    )
    assert engine.max_images_per_request == 3
    assert engine.image_limits.max_bytes == 500
