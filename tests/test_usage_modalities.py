"""Per-modality usage: ``prompt_tokens_details.image_tokens`` and ``video_tokens`` beside
``cached_tokens`` in chat (plain, streamed, ``n``), Responses and ``/ask``, and
``mmserve_prompt_tokens_total{modality}``; prompt = text + image + video, checked against
the engine requests' own prompts (text ids are the non-negative ones; each image span's
positions; each video's frame spans and its newline)."""

from __future__ import annotations

import base64
import io

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from api.app import ServerSettings, create_app
from mmserve.vision.hashing import VIDEO_NEWLINE_ID
from tests.helpers import MODEL, png_bytes, stream_chunks, upload
from tests.videos import encode_mp4, rgb_frames


@pytest.fixture(scope="module", params=["llava", "llava-onevision"])
def api(request, families):
    """A server on a family without a video path (LLaVA-1.5: a video is its frames as
    images) and one with (OneVision: pooled frames and a newline); it records every
    engine request it submits (``api.submitted``)."""
    engine = families[request.param].make_engine(max_total_tokens=16384)
    with TestClient(create_app(engine, ServerSettings(served_model_name=MODEL))) as c:
        client = c.app.state.mm.client
        submit = client.submit
        c.submitted = []

        def recording(reqs, *args, **kwargs):
            c.submitted.append(list(reqs))
            return submit(reqs, *args, **kwargs)

        client.submit = recording
        c.engine = engine
        c.family = request.param
        yield c


def _expected(req) -> dict:
    """Text, image and video tokens of one engine request's prompt, from its ids and spans."""
    ids = list(req.input_ids)
    frames = [s for s in req.spans if s.image.video]
    images = [s for s in req.spans if not s.image.video]
    text = sum(1 for t in ids if t >= 0)
    image = sum(s.length for s in images)
    video = sum(s.length for s in frames) + ids.count(VIDEO_NEWLINE_ID)
    assert text + image + video == len(ids)  # every position is one of the three
    return {"text": text, "image": image, "video": video}


def _check(usage: dict, req, prompt_key: str = "prompt_tokens") -> dict:
    details_key = (
        "prompt_tokens_details" if prompt_key == "prompt_tokens" else "input_tokens_details"
    )
    want = _expected(req)
    d = usage[details_key]
    assert d["image_tokens"] == want["image"] and d["video_tokens"] == want["video"], (d, want)
    assert usage[prompt_key] == want["text"] + want["image"] + want["video"]
    return want


def _content(photos: dict[str, bytes]) -> list[dict]:
    clip = encode_mp4(rgb_frames(6), fps=10)
    video = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    wide = Image.open(io.BytesIO(photos["astronaut.png"])).convert("RGB").resize((260, 130))
    image = "data:image/png;base64," + base64.b64encode(png_bytes(wide)).decode()
    return [
        {"type": "text", "text": "Look:"},
        {"type": "image_url", "image_url": {"url": image}},
        {"type": "video_url", "video_url": {"url": video, "num_frames": 2}},
        {"type": "text", "text": "What changes?"},
    ]


def test_chat_usage_adds_up_per_modality(api, photos) -> None:
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "n": 2}
    body["messages"] = [{"role": "user", "content": _content(photos)}]
    r = api.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (req, _) = api.submitted[-1]
    want = _check(r.json()["usage"], req)
    # the families' own counts: LLaVA-1.5's frames are 576-token images; OneVision's
    # video is its pooled frames and one newline
    loaded = api.engine.model
    if api.family == "llava":
        assert want["image"] == 576 and want["video"] == 2 * 576
    else:
        assert want["image"] == loaded.image_tokens(260, 130)
        assert want["video"] == 2 * loaded.family.video_frame_tokens() + 1
    assert want["text"] > 0

    chunks = stream_chunks(api, {**body, "stream_options": {"include_usage": True}})
    (req, _) = api.submitted[-1]
    streamed = chunks[-1]["usage"]
    assert _check(streamed, req) == want
    assert streamed["prompt_tokens_details"]["cached_tokens"] == streamed["prompt_tokens"] - 1


def test_text_only_usage_has_zero_media(api) -> None:
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    r = api.post("/v1/chat/completions", json=body)
    d = r.json()["usage"]["prompt_tokens_details"]
    assert (d["image_tokens"], d["video_tokens"]) == (0, 0)


def test_responses_and_ask_report_image_tokens(api, photos) -> None:
    image_id = upload(api, photos["cat.png"]).json()["id"]
    part = {"type": "input_image", "image_url": image_id}
    body = {"model": MODEL, "max_output_tokens": 1}
    body["input"] = [{"role": "user", "content": [part, {"type": "input_text", "text": "Hi"}]}]
    r = api.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    (req,) = api.submitted[-1]
    want = _check(r.json()["usage"], req, "input_tokens")
    assert want["image"] > 0 and want["video"] == 0

    r = api.post(f"/v1/images/{image_id}/ask", json={"questions": ["A?", "B?"], "max_tokens": 1})
    assert r.status_code == 200, r.text
    reqs = api.submitted[-1]
    out = r.json()
    for answer, req in zip(out["answers"], reqs, strict=True):
        _check(answer["usage"], req)
    total = out["usage"]["prompt_tokens_details"]
    assert total["image_tokens"] == sum(_expected(q)["image"] for q in reqs)
    assert total["video_tokens"] == 0


def test_metrics_count_prompt_tokens_by_modality(api, photos) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def by_modality() -> dict[str, float]:
        fams = text_string_to_metric_families(api.get("/metrics").text)
        return {
            s.labels["modality"]: s.value
            for f in fams
            for s in f.samples
            if s.name == "mmserve_prompt_tokens_total"
        }

    before = by_modality()
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0}
    body["messages"] = [{"role": "user", "content": _content(photos)}]
    r = api.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (req,) = api.submitted[-1]
    want = _expected(req)
    after = by_modality()
    assert set(after) == {"text", "image", "video"}
    assert {k: after[k] - before.get(k, 0) for k in after} == want
