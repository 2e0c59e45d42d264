"""The image store (bounded, content-addressed, persistent) and the /v1/images routes, /ask."""

from __future__ import annotations

import base64

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from api.app import ServerSettings, create_app
from api.image_store import ImageStore
from tests.helpers import png_bytes

MODEL = "llava-tiny"


def solid(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> Image.Image:
    return Image.new("RGB", size, color)


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_total_tokens=8192)


# ---- the store itself -------------------------------------------------------------------


def test_same_pixels_any_container_is_one_entry(engine) -> None:
    store = ImageStore(engine.processor.prepare_image, max_images=8)
    im = solid((10, 20, 30))
    a = store.put(png_bytes(im))
    b = store.put(png_bytes(im, "BMP"))
    c = store.put(png_bytes(im))
    assert a.id == b.id == c.id and len(store) == 1
    # the store holds the first file, never the decoded pixels (40 * 30 * 3 bytes)
    assert store.total_bytes == len(png_bytes(im)) and a.image is None
    assert (a.width, a.height, a.source) == (40, 30, png_bytes(im))
    assert store.put(png_bytes(solid((10, 20, 31)))).id != a.id


def test_lru_bound_by_count(engine) -> None:
    store = ImageStore(engine.processor.prepare_image, max_images=3)
    ids = [store.put(png_bytes(solid((i, 0, 0)))).id for i in range(3)]
    assert store.get(ids[0]) is not None  # now most recently used
    new = store.put(png_bytes(solid((99, 0, 0)))).id
    assert len(store) == 3
    assert store.get(ids[1]) is None  # the least recently used went
    assert [e.image.id for e in store.list()] == [new, ids[0], ids[2]]


def test_lru_bound_by_bytes(engine) -> None:
    files = [png_bytes(solid((0, i, 0))) for i in range(5)]
    cap = len(files[3]) + len(files[4])
    assert cap + min(len(f) for f in files[:3]) > cap  # a third file never fits
    store = ImageStore(engine.processor.prepare_image, max_images=100, max_bytes=cap)
    ids = [store.put(f).id for f in files]
    assert len(store) == 2 and store.total_bytes == cap
    assert [e.image.id for e in store.list()] == [ids[4], ids[3]]


def test_delete(engine) -> None:
    store = ImageStore(engine.processor.prepare_image)
    data = png_bytes(solid((1, 2, 3)))
    image_id = store.put(data).id
    assert store.delete(image_id) and not store.delete(image_id)
    assert store.get(image_id) is None and store.total_bytes == 0
    assert store.put(data).id == image_id  # the bytes memo does not resurrect a stale entry


def test_persistence_survives_a_restart(engine, tmp_path) -> None:
    a, b, c = (png_bytes(solid((0, 0, i))) for i in (1, 2, 3))
    store = ImageStore(engine.processor.prepare_image, max_images=2, directory=tmp_path)
    ida = store.put(a).id
    idb = store.put(b).id
    data_url_id = store.put(c, persist=False).id  # evicts a; c is memory-only
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{idb}.img"]
    assert store.delete(idb) and not list(tmp_path.iterdir())
    idb = store.put(b).id
    ida = store.put(a).id
    assert len(list(tmp_path.iterdir())) == 2
    again = ImageStore(engine.processor.prepare_image, max_images=2, directory=tmp_path)
    assert {e.image.id for e in again.list()} == {ida, idb}
    assert again.get(data_url_id) is None
    assert again.get(ida).source == store.get(ida).source == a
    assert again.put(a).id == ida and len(again) == 2
    smaller = ImageStore(engine.processor.prepare_image, max_images=1, directory=tmp_path)
    assert len(smaller) == 1 and len(list(tmp_path.iterdir())) == 1


# ---- HTTP routes --------------------------------------------------------------------------


@pytest.fixture()
def client(engine, tmp_path):
    settings = ServerSettings(served_model_name=MODEL, image_store_dir=str(tmp_path / "store"))
    with TestClient(create_app(engine, settings)) as c:
        c.settings = settings
        yield c


def upload(client, data: bytes):
    r = client.post("/v1/images", files={"file": ("x.png", data, "application/octet-stream")})
    assert r.status_code == 200, r.text
    return r.json()


def test_upload_list_get_delete(client, photos) -> None:
    cat = upload(client, photos["cat.png"])
    assert cat["object"] == "image" and cat["bytes"] == len(photos["cat.png"])
    again = client.post(
        "/v1/images", json={"data": base64.b64encode(photos["cat.png"]).decode()}
    ).json()
    assert again == cat  # idempotent: same id, same metadata
    rocket = upload(client, photos["rocket.jpg"])
    listed = client.get("/v1/images").json()
    assert listed["object"] == "list"
    assert [d["id"] for d in listed["data"]] == [rocket["id"], cat["id"]]
    assert client.get(f"/v1/images/{cat['id']}").json() == cat
    r = client.delete(f"/v1/images/{cat['id']}")
    assert r.json() == {"id": cat["id"], "object": "image.deleted", "deleted": True}
    assert client.get(f"/v1/images/{cat['id']}").status_code == 404
    assert [d["id"] for d in client.get("/v1/images").json()["data"]] == [rocket["id"]]
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": cat["id"]}}]}
        ],
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "unknown image id" in r.json()["error"]["message"]


def test_uploads_survive_an_app_restart(engine, tmp_path, photos) -> None:
    settings = ServerSettings(served_model_name=MODEL, image_store_dir=str(tmp_path))
    with TestClient(create_app(engine, settings)) as c:
        cat = upload(c, photos["cat.png"])
    with TestClient(create_app(engine, settings)) as c:
        assert c.get(f"/v1/images/{cat['id']}").json()["id"] == cat["id"]
        assert [d["id"] for d in c.get("/v1/images").json()["data"]] == [cat["id"]]


def test_ask_answers_every_question_with_one_image_prefill(client, photos) -> None:
    image_id = upload(client, photos["coffee.png"])["id"]
    questions = ["What is this?", "What colour is it?", "Is it hot?", "Who made it?"]
    before = client.get("/v1/cache/stats").json()
    r = client.post(
        f"/v1/images/{image_id}/ask",
        json={"questions": questions, "max_tokens": 4, "temperature": 0, "model": MODEL},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    after = client.get("/v1/cache/stats").json()
    assert body["object"] == "image.answers" and body["image_id"] == image_id
    answers = body["answers"]
    assert [a["question"] for a in answers] == questions
    assert after["vision_tower_images"] - before["vision_tower_images"] == 1
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached[0] < 576 and all(c >= 576 for c in cached[1:]), cached
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == sum(cached)
    # the same answers as asking one by one through chat completions (greedy)
    for a in answers:
        content = [
            {"type": "image_url", "image_url": {"url": image_id}},
            {"type": "text", "text": a["question"]},
        ]
        one = client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "max_tokens": 4,
                "temperature": 0,
                "messages": [{"role": "user", "content": content}],
            },
        ).json()
        assert one["choices"][0]["message"]["content"] == a["answer"]
        assert one["usage"]["prompt_tokens"] == a["usage"]["prompt_tokens"]


def test_ask_limits(client, photos) -> None:
    image_id = upload(client, photos["cat.png"])["id"]
    url = f"/v1/images/{image_id}/ask"
    r = client.post(url, json={"questions": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "questions"
    r = client.post(url, json={"questions": ["q"] * 33})
    assert r.status_code == 400 and "limit is 32" in r.json()["error"]["message"]
    r = client.post(url, json={"questions": ["q"], "model": "other"})
    assert r.status_code == 404
    r = client.post(url, json={"questions": ["q"], "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = client.post(url, json={"questions": ["q <image>"]})
    assert r.status_code == 400 and "placeholder" in r.json()["error"]["message"]
    r = client.post(url, json={"questions": ["Hi"], "system": "Be brief.", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["answers"][0]["usage"]["completion_tokens"] == 2


def test_data_urls_never_evict_uploads(engine, photos) -> None:
    settings = ServerSettings(served_model_name=MODEL, max_stored_images=1)
    with TestClient(create_app(engine, settings)) as c:
        kept = upload(c, photos["cat.png"])
        for i in range(3):
            url = "data:image/png;base64," + base64.b64encode(png_bytes(solid((i, 9, 9)))).decode()
            content = [{"type": "image_url", "image_url": {"url": url}}]
            r = c.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "max_tokens": 1,
                    "messages": [{"role": "user", "content": content}],
                },
            )
            assert r.status_code == 200, r.text
        assert [d["id"] for d in c.get("/v1/images").json()["data"]] == [kept["id"]]
        assert c.get(f"/v1/images/{kept['id']}").status_code == 200


def test_deleted_id_is_unknown_in_chat_even_after_a_data_url(engine, photos) -> None:
    with TestClient(create_app(engine, ServerSettings(served_model_name=MODEL))) as c:
        data = photos["cat.png"]
        url = "data:image/png;base64," + base64.b64encode(data).decode()
        image_id = upload(c, data)["id"]
        for ref in (url, image_id):
            content = [{"type": "image_url", "image_url": {"url": ref}}]
            body = {
                "model": MODEL,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": content}],
            }
            assert c.post("/v1/chat/completions", json=body).status_code == 200
        assert c.delete(f"/v1/images/{image_id}").status_code == 200
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "image_not_found"
