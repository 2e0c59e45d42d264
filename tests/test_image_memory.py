"""Memory that images may take: preprocessing in the front end, budgets, no decoded-image cache.

The engine thread must never run the image processor for a request the front end built
(its items carry ``pixels`` or cached ``features``); a request's decoded pixels and the
server's decoded bytes are bounded (400 naming the image, 503 with Retry-After); the
stores keep keys and files, never decoded images; per-image preprocessing gives the
values a batched call gives (so tokens stay those of transformers, which the reference
tests pin per family).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from api.app import ServerSettings, create_app
from mmserve.model.families.base import BASE_MODE, FRAME_MODE, IMAGE_MODE
from mmserve.vision.budget import DecodeBudget, DecodeBusyError, RequestPixels, decoded_bytes
from mmserve.vision.frames import prepare_frames
from mmserve.vision.image import ImageError
from tests.helpers import MODEL, assert_error, chat, data_url, greedy, image_part, png_bytes, user


def noise(size: tuple[int, int], seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


# ---- per-image preprocessing equals the batched call --------------------------------------


def test_llava_per_image_pixels_equal_batched(loaded) -> None:
    ims = [noise((50, 40), 1), noise((31, 77), 2)]
    batched = loaded.processor.image_processor(images=ims, return_tensors="pt")["pixel_values"]
    for k, im in enumerate(ims):
        (px,) = loaded.family.preprocess([im], IMAGE_MODE)
        assert px.mode == IMAGE_MODE and px.values.dtype == torch.float32
        assert torch.equal(px.values, batched[k : k + 1])
    with pytest.raises(ValueError, match="frame"):
        loaded.family.preprocess(ims, FRAME_MODE)


def test_next_per_image_tiles_equal_batched(families) -> None:
    next_loaded = families["llava-next"].loaded
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    fam, cfg = next_loaded.family, next_loaded.family.config
    ims = [noise((120, 40), 3), noise((40, 40), 4)]  # different grids: the batch pads
    out = next_loaded.processor.image_processor(images=ims, return_tensors="pt")
    for k, im in enumerate(ims):
        (px,) = fam.preprocess([im], IMAGE_MODE)
        n = image_size_to_num_patches(
            out["image_sizes"][k], cfg.image_grid_pinpoints, cfg.vision_config.image_size
        )
        assert torch.equal(px.values, out["pixel_values"][k][:n])
        assert torch.equal(px.image_size, out["image_sizes"][k])


def test_onevision_base_and_frames_equal_batched(families) -> None:
    ov_loaded = families["llava-onevision"].loaded
    fam = ov_loaded.family
    ims = [noise((90, 30), 5), noise((33, 64), 6), noise((64, 64), 7)]
    # transformers' batch of one prompt holding three images (base mode)
    out = ov_loaded.processor.image_processor(images=[ims], return_tensors="pt")
    frames = prepare_frames(ims, fam.frame_prep)
    for k, im in enumerate(ims):
        (base,) = fam.preprocess([im], BASE_MODE)
        assert torch.equal(base.values, out["pixel_values"][k : k + 1, 0])
        assert torch.equal(base.image_size, out["image_sizes"][k])
        (fr,) = fam.preprocess([im], FRAME_MODE)
        assert torch.equal(fr.values, frames[k : k + 1])


# ---- the engine thread never preprocesses ------------------------------------------------


def test_engine_thread_never_runs_the_image_processor(make_engine, monkeypatch) -> None:
    eng = make_engine()
    ip = eng.model.processor.image_processor
    threads: list[str] = []
    real = type(ip).__call__

    def spy(self, *a, **kw):
        threads.append(threading.current_thread().name)
        return real(self, *a, **kw)

    monkeypatch.setattr(type(ip), "__call__", spy)
    app = create_app(eng, ServerSettings(served_model_name=MODEL))
    with TestClient(app) as c:
        parts = [image_part(data_url(png_bytes(noise((40, 30), s)))) for s in (10, 11)]
        r = chat(c, [*parts, {"type": "text", "text": "Compare."}])
        assert r.status_code == 200, r.text
        stats = c.get("/v1/cache/stats").json()
    assert len(threads) == 2  # one call per image, each on a front-end worker thread
    assert "mmserve-engine" not in threads
    assert stats["vision_tower_images"] == 2  # the tower did run, on pixels
    assert stats["running_requests"] == 0


def test_request_items_carry_pixels_or_cached_features(engine) -> None:
    im = noise((40, 30), 20)
    data = png_bytes(im)
    p = engine.processor
    first = p.prepare_image(data, IMAGE_MODE)
    assert first.image is None and first.pixels is not None and first.source == data
    req = p.make_request(messages=user(None, "Hi"), images=[first], params=greedy(3))
    (item,) = [s.image for s in req.spans]
    assert item.image is None and item.source is None and item.features is None
    assert item.pixels.values.shape[0] == 1
    want = engine.generate([req])[0]
    # now cached: the front end skips preprocessing and the request holds the features
    again = p.prepare_image(data, IMAGE_MODE)
    assert again.key == first.key and again.pixels is None
    req2 = p.make_request(messages=user(None, "Hi"), images=[again], params=greedy(3))
    (item2,) = [s.image for s in req2.spans]
    assert item2.pixels is None and item2.features is not None
    # the embedding cache and the prefix cache lose everything before the engine runs it
    engine.flush_cache()
    assert len(engine.embedding_cache) == 0
    got = engine.generate([req2])[0]
    assert got.output_ids == want.output_ids and got.vision_tower_runs == 0


def test_evicted_between_prepare_and_request_decodes_again(engine) -> None:
    data = png_bytes(noise((40, 30), 21))
    p = engine.processor
    cold = p.make_request(
        messages=user(None, "Hi"), images=[p.prepare_image(data, IMAGE_MODE)], params=greedy(3)
    )
    want = engine.generate([cold])[0]
    prepared = p.prepare_image(data, IMAGE_MODE)  # features cached: no pixels made
    assert prepared.pixels is None
    engine.flush_cache()
    req = p.make_request(messages=user(None, "Hi"), images=[prepared], params=greedy(3))
    (item,) = [s.image for s in req.spans]
    assert item.pixels is not None and item.features is None and item.source is None
    got = engine.generate([req])[0]
    assert got.output_ids == want.output_ids and got.vision_tower_runs == 1


# ---- budgets ------------------------------------------------------------------------------


def test_decoded_bytes_counts_channels_and_depth() -> None:
    assert decoded_bytes(6000, 6000, "RGB") == 108_000_000
    assert decoded_bytes(10, 10, "RGBA") == 400
    assert decoded_bytes(10, 10, "I;16") == 200 and decoded_bytes(10, 10, "F") == 400
    assert decoded_bytes(10, 10, "P") == 100


def test_request_pixels_refuse_past_the_limit() -> None:
    px = RequestPixels(2500)
    px.charge(40, 30)
    px.charge(40, 30)
    with pytest.raises(ImageError, match="max-request-image-pixels") as e:
        px.charge(10, 11)
    assert "2510" in str(e.value) and px.used == 2400


def test_decode_budget_waits_for_room_then_refuses() -> None:
    b = DecodeBudget(1000, wait_seconds=30)
    b.acquire(800)
    got = threading.Event()

    def second() -> None:
        b.acquire(500)
        got.set()

    t = threading.Thread(target=second)
    t.start()
    while b.waits == 0:  # the second acquisition is waiting
        threading.Event().wait(0.01)
    assert not got.is_set()
    b.release(800)
    t.join(timeout=30)
    assert got.is_set() and b.in_use == 500 and b.peak == 800
    quick = DecodeBudget(1000, wait_seconds=0)
    quick.acquire(600)
    with pytest.raises(DecodeBusyError) as e:
        quick.acquire(600)
    assert quick.refusals == 1 and e.value.retry_after >= 1
    with pytest.raises(ImageError, match="max-decoded-image-bytes"):
        quick.acquire(1001)  # could never fit: a 400, not a 503


def app_client(make_engine, **cfg):
    eng = make_engine(**cfg)
    return eng, TestClient(create_app(eng, ServerSettings(served_model_name=MODEL)))


def test_request_pixel_budget_is_a_400_naming_the_image(make_engine) -> None:
    eng, client = app_client(make_engine, max_request_image_pixels=2500)
    with client as c:
        one = image_part(data_url(png_bytes(noise((40, 30), 30))))
        two = image_part(data_url(png_bytes(noise((40, 30), 31))))
        ok = chat(c, [one, {"type": "text", "text": "Hi"}])
        assert ok.status_code == 200, ok.text
        r = chat(c, [one, {"type": "text", "text": "Hi"}, two, two])
        err = assert_error(
            r, 400, "--max-request-image-pixels", code="request_image_pixels_exceeded"
        )
        assert err["param"] == "messages[0].content[3].image_url.url"  # the third image
        # an uploaded image counts the same way, without being decoded
        up = c.post("/v1/images", files={"file": ("a.png", png_bytes(noise((40, 30), 32)))})
        url = image_part(up.json()["id"])
        r = chat(c, [url, url, url])
        err = assert_error(r, 400, "pixels", code="request_image_pixels_exceeded")
        assert err["param"] == "messages[0].content[2].image_url.url"
        assert eng.processor.decode_budget.in_use == 0


def test_server_decode_budget_is_a_503_with_retry_after(make_engine) -> None:
    size = decoded_bytes(40, 30, "RGB")
    eng, client = app_client(
        make_engine, max_decoded_image_bytes=2 * size, decoded_image_wait_seconds=0
    )
    part = image_part(data_url(png_bytes(noise((40, 30), 40))))
    with client as c:
        # the API process's budget (its front end's: the engine's own in one process)
        budget = c.app.state.mm.engine.processor.decode_budget
        budget.acquire(size + 1)  # other requests hold most of it
        r = chat(c, [part, {"type": "text", "text": "Hi"}])
        assert_error(r, 503, "--max-decoded-image-bytes", code="image_decode_busy")
        assert int(r.headers["Retry-After"]) >= 1
        metrics = c.get("/metrics").text
        assert "mmserve_image_decode_refusals_total 1.0" in metrics
        budget.release(size + 1)
        r = chat(c, [part, {"type": "text", "text": "Hi"}])
        assert r.status_code == 200, r.text
        big = image_part(data_url(png_bytes(noise((80, 60), 41))))  # larger than the budget
        err = assert_error(chat(c, [big]), 400, "--max-decoded-image-bytes", "invalid_image")
        assert err["param"] == "messages[0].content[0].image_url.url"
        assert budget.in_use == 0 and budget.peak <= 2 * size


def test_make_request_refuses_past_the_pixel_budget(make_engine) -> None:
    eng = make_engine(max_request_image_pixels=2000)
    img = eng.processor.prepare_image(png_bytes(noise((40, 30), 50)))
    eng.processor.make_request(messages=user(None, "a"), images=[img], params=greedy(2))
    from mmserve.frontend.processor import RequestError

    with pytest.raises(RequestError, match="max-request-image-pixels") as e:
        eng.processor.make_request(
            messages=user(None, None, "a"), images=[img, img], params=greedy(2)
        )
    assert e.value.param == "messages"


# ---- no decoded-image cache ---------------------------------------------------------------


def test_stores_hold_no_decoded_images_and_metrics_count_them(make_engine) -> None:
    eng, client = app_client(make_engine)
    with client as c:
        data = png_bytes(noise((40, 30), 60))
        up = c.post("/v1/images", files={"file": ("a.png", data)}).json()
        parts = [image_part(data_url(png_bytes(noise((40, 30), 61)))), image_part(up["id"])]
        r = chat(c, [*parts, {"type": "text", "text": "Hi"}])
        assert r.status_code == 200, r.text
        st = c.app.state.mm
        for store in (st.store, st.media.transient):
            for e in store.list():
                assert e.image.image is None and e.image.pixels is None
        assert [e.image.source for e in st.media.transient.list()] == [None]
        assert st.store.total_bytes == len(data)
        info = c.get(f"/v1/images/{up['id']}").json()
        assert (info["width"], info["height"], info["mode"]) == (40, 30, "RGB")
        text = c.get("/metrics").text
        assert f"mmserve_image_store_bytes {float(len(data))}" in text
        assert "mmserve_decoded_image_bytes 0.0" in text
        peak = decoded_bytes(40, 30, "RGB")  # one image at a time: never both
        assert f"mmserve_decoded_image_bytes_peak {float(peak)}" in text
