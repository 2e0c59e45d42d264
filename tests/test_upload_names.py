"""Stored images and videos keep a display name and have thumbnails (issue 47.3): the
listing and GET carry ``name`` and ``thumbnail_url``, names are cleaned and bounded, an
image's name survives a restart with ``--image-store-dir``."""

from __future__ import annotations

import base64
import io

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from api.app import ServerSettings, create_app
from api.uploads import MAX_NAME_CHARS, clean_name
from tests.helpers import SAMPLES

MODEL = "llava-tiny"
VIDEO = SAMPLES.parent / "video" / "pans.mp4"


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_total_tokens=8192)


def _app(engine, store_dir) -> TestClient:
    settings = ServerSettings(served_model_name=MODEL, image_store_dir=str(store_dir))
    return TestClient(create_app(engine, settings))


def _jpeg_size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == "JPEG"
        return im.size


def test_clean_name_strips_controls_paths_and_bounds_length() -> None:
    assert clean_name("C:\\photos\\cat.png") == "cat.png"
    assert clean_name("../../etc/passwd") == "passwd"
    assert clean_name(" a\x00b\nc\u202ed.png\t") == "abcd.png"
    assert len(clean_name("x" * 10_000)) == MAX_NAME_CHARS


def test_image_names_thumbnails_and_restart(engine, tmp_path) -> None:
    photo = (SAMPLES / "cat.png").read_bytes()
    with _app(engine, tmp_path / "store") as c:
        r = c.post("/v1/images", files={"file": ("my cat.png", photo, "image/png")})
        assert r.status_code == 200, r.text
        info = r.json()
        image_id = info["id"]
        assert info["name"] == "my cat.png"
        assert info["thumbnail_url"] == f"/v1/images/{image_id}/thumbnail"
        listed = c.get("/v1/images").json()["data"]
        assert [(e["id"], e["name"]) for e in listed] == [(image_id, "my cat.png")]
        t = c.get(info["thumbnail_url"])
        assert t.status_code == 200 and t.headers["content-type"] == "image/jpeg"
        assert _jpeg_size(t.content) == (256, 170)  # 451x300 fitted into 256
        assert c.get(info["thumbnail_url"]).content == t.content  # cached, same bytes
        # a JSON upload of the same pixels changes nothing: the first name stays
        body = {"data": base64.b64encode(photo).decode(), "name": "renamed.png"}
        assert c.post("/v1/images", json=body).json()["name"] == "my cat.png"
        assert c.post("/v1/images", json={**body, "name": 3}).json()["error"]["param"] == "name"
        bad = c.post("/v1/images", json={**body, "nom": "x"}).json()["error"]
        assert bad["param"] == "nom"
        assert c.get("/v1/images/img-" + "0" * 32 + "/thumbnail").status_code == 404
        # a JSON upload named by its field: control and format characters dropped
        rocket = base64.b64encode((SAMPLES / "rocket.jpg").read_bytes()).decode()
        named = c.post("/v1/images", json={"data": rocket, "name": "a\x00b\u202e.jpg"})
        assert named.json()["name"] == "ab.jpg"
        assert c.delete(f"/v1/images/{named.json()['id']}").status_code == 200
    with _app(engine, tmp_path / "store") as c:  # a restart keeps the name
        assert c.get(f"/v1/images/{image_id}").json()["name"] == "my cat.png"
        assert c.get(f"/v1/images/{image_id}/thumbnail").status_code == 200
        assert c.delete(f"/v1/images/{image_id}").status_code == 200
        assert c.get(f"/v1/images/{image_id}/thumbnail").status_code == 404
    assert not list((tmp_path / "store").iterdir())  # file and name both gone


def test_video_name_and_first_frame_thumbnail(engine, tmp_path) -> None:
    with _app(engine, tmp_path / "store") as c:
        form = {"name": "pans\r\n.mp4"}
        r = c.post("/v1/videos", files={"file": ("x.mp4", VIDEO.read_bytes())}, data=form)
        assert r.status_code == 200, r.text
        info = r.json()
        assert info["name"] == "pans.mp4"
        assert c.get("/v1/videos").json()["data"][0]["name"] == "pans.mp4"
        assert c.get(f"/v1/videos/{info['id']}").json()["thumbnail_url"] == info["thumbnail_url"]
        t = c.get(info["thumbnail_url"])
        assert t.status_code == 200
        w, h = _jpeg_size(t.content)
        assert max(w, h) <= 256 and w * info["height"] == pytest.approx(h * info["width"], rel=0.02)
        assert c.get("/v1/videos/vid-" + "0" * 32 + "/thumbnail").status_code == 404
