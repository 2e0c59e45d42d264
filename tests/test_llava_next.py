"""LLaVA-NeXT only: images of different sizes never share image K/V, the per-request
image-token limit is checked before any tower run, per-frame video QA. Greedy equality
with transformers and token counts for every family are in tests/test_families.py."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.app import ServerSettings, create_app
from tests.helpers import (
    MODEL,
    ROOT,
    assert_error,
    chat,
    chat_json,
    data_url,
    image_part,
    tower_runs,
    user,
)


@pytest.fixture(scope="module")
def make_next_engine(families):
    return families["llava-next"].make_engine


def test_two_images_of_different_sizes_never_share_image_kv(make_next_engine, shapes) -> None:
    eng = make_next_engine()
    with TestClient(create_app(eng, ServerSettings(served_model_name=MODEL))) as c:
        a = chat_json(c, [image_part(data_url(shapes["wide"]))], max_tokens=8)
        b = chat_json(c, [image_part(data_url(shapes["square"]))], max_tokens=8)
        img = eng.processor.prepare_image(shapes["square"])
        prefix = eng.processor.make_request(messages=user(None), images=[img]).spans[0].start
        # only the text before the image (the chat template's opening) can be shared
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] <= prefix
        assert a["usage"]["prompt_tokens"] != b["usage"]["prompt_tokens"]


def test_too_many_image_tokens_is_a_400_before_any_tower_run(make_next_engine, shapes) -> None:
    eng = make_next_engine(max_image_tokens_per_request=300)
    with TestClient(create_app(eng, ServerSettings(served_model_name=MODEL))) as c:
        parts = [image_part(data_url(shapes[k])) for k in ("wide", "tall")]
        r = chat(c, parts, max_tokens=2)
        err = assert_error(r, 400, "--max-image-tokens-per-request")
        sizes = [
            eng.processor.image_tokens(eng.processor.prepare_image(shapes[k]))
            for k in ("wide", "tall")
        ]
        assert f"{sizes[0]}, {sizes[1]} tokens" in err["message"]
        assert tower_runs(c) == 0
        assert chat_json(c, "hello", max_tokens=2)["usage"]["completion_tokens"] == 2


def test_video_per_frame_qa_on_next(make_next_engine) -> None:
    eng = make_next_engine()
    video = (ROOT / "samples" / "video" / "pans.mp4").read_bytes()
    with TestClient(create_app(eng, ServerSettings(served_model_name=MODEL))) as c:
        vid = c.post("/v1/videos", files={"file": ("v.mp4", video)}).json()["id"]
        r = c.post(
            f"/v1/videos/{vid}/qa",
            json={"questions": ["What is here?"], "num_frames": 3, "max_tokens": 3},
        )
        assert r.status_code == 200, r.text
        events = [ln for ln in r.text.splitlines() if ln.strip()]
        assert sum('"answer"' in e for e in events) == 3, events[:4]
        assert tower_runs(c) == 3
