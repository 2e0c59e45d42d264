"""Frame sampling fields (``num_frames``, ``fps``, ``timestamps``, ``max_frames``,
``max_video_tokens``): how they combine, which field a 400 names and the limit it gives,
on ``/v1/videos/{id}/qa`` and chat ``video_url`` parts alike (issue 31 part 3)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from mmserve.vision.video import FrameCost, FrameSelection, VideoError, sample_frame_indices
from tests.helpers import upload_video, video_qa
from tests.live_server import app_client
from tests.videos import encode_mp4, rgb_frames

pytest.importorskip("av")

#: this file's server: at most 16 frames per request; the tiny LLaVA-1.5 (no video path:
#: a frame is a 576-token image) takes at most 8 images per request
LIMITS = {"max_video_bytes": 200_000, "max_video_frames": 16, "max_video_side": 640}
FIELDS = ("num_frames", "fps", "timestamps", "max_frames", "max_video_tokens")
TS9 = [round(0.1 * i, 1) for i in range(9)]
TS17 = [0.05 * i for i in range(17)]

#: (fields, the field a 400 names (None: answered), words of its message / frames taken).
#: The clip: 12 frames at 10 fps (1.2 s).
CASES = [
    # one selector, each limit it can cross
    ({"fps": 10}, "fps", "8 images per"),  # 12 frames: the report
    ({"fps": 10.5}, "fps", "8 images per"),
    ({"fps": 100}, "fps", "8 images per"),  # thinned to 16 frames: 12, all of them
    ({"fps": 0.5}, None, 1),
    ({"num_frames": 9}, "num_frames", "8 images per"),
    ({"num_frames": 17}, "num_frames", "limit is 16 frames per request"),
    ({"num_frames": 0}, "num_frames", "greater than or equal to 1"),
    ({"timestamps": TS9}, "timestamps", "8 images per"),
    ({"timestamps": TS17}, "timestamps", "limit is 16 frames per request"),
    ({"timestamps": [5.0]}, "timestamps", "duration (1.2 s)"),
    ({"timestamps": []}, "timestamps", "empty"),
    # two selectors contradict: the second is named
    ({"num_frames": 2, "fps": 1}, "fps", "give one of"),
    ({"fps": 1, "timestamps": [0.0]}, "timestamps", "give one of"),
    ({"num_frames": 2, "timestamps": [0.0]}, "timestamps", "give one of"),
    # max_frames: a cap fps and the default are thinned to, a contradiction for exact counts
    ({"max_frames": 17}, "max_frames", "limit of 16 frames per request"),
    ({"max_frames": 0}, "max_frames", "greater than or equal to 1"),
    ({"max_frames": 4}, None, 4),
    ({"max_frames": 12}, None, 8),  # the default 8, under the cap
    ({"fps": 10, "max_frames": 6}, None, 6),
    ({"fps": 10, "max_frames": 9}, "max_frames", "8 images per"),
    ({"fps": 2, "max_frames": 9}, None, 3),
    ({"num_frames": 9, "max_frames": 8}, "num_frames", "more than max_frames=8"),
    ({"num_frames": 3, "max_frames": 8}, None, 3),
    ({"timestamps": [0.0, 0.5, 1.0], "max_frames": 2}, "timestamps", "more than max_frames=2"),
    ({"timestamps": [0.0, 0.5], "max_frames": 2}, None, 2),
    # max_video_tokens (576 tokens a frame here): fps and the default thinned to fit
    ({"max_video_tokens": 100}, "max_video_tokens", "room for none"),
    ({"max_video_tokens": 1200}, None, 2),
    ({"fps": 10, "max_video_tokens": 1800}, None, 3),
    ({"num_frames": 3, "max_video_tokens": 1200}, "num_frames", "max_video_tokens=1200 fits 2"),
    (
        {"timestamps": [0.0, 0.5, 1.0], "max_video_tokens": 600},
        "timestamps",
        "max_video_tokens=600 fits 1 frame",
    ),
    ({"fps": 10, "max_frames": 5, "max_video_tokens": 1800}, None, 3),
]


@pytest.fixture(scope="module")
def client(make_engine):
    with app_client(make_engine(max_total_tokens=16384), **LIMITS) as c:
        yield c


@pytest.fixture(scope="module")
def vid(client: TestClient) -> str:
    return upload_video(client, encode_mp4(rgb_frames(12, seed=3), fps=10)).json()["id"]


def _check(r, field: str | None, want, param: str) -> None:
    if field is None:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param + field, err
    assert want in err["message"], err


@pytest.mark.parametrize(("fields", "field", "want"), CASES)
def test_qa_names_the_field_set_and_the_limit(client, vid, fields, field, want) -> None:
    body = {"questions": ["What?"], "mode": "clip", "max_tokens": 1, **fields}
    r = client.post(f"/v1/videos/{vid}/qa", json=body)
    _check(r, field, want, "")
    if field is None:  # the frames taken, each reported with its time
        events = video_qa(client, vid, **body)
        frames = events[0]["frames"]
        assert len(frames) == events[-1]["frames"] == want
        assert all(f["timestamp"] == pytest.approx(0.1 * f["frame_index"]) for f in frames)


@pytest.mark.parametrize("on_part", [False, True], ids=["on_video_url", "on_part"])
@pytest.mark.parametrize(("fields", "field", "want"), CASES)
def test_chat_video_url_names_the_field_set_and_the_limit(
    client,
    vid,
    fields,
    field,
    want,
    on_part,
) -> None:
    if on_part:
        part = {"type": "video_url", "video_url": vid, **fields}
        at = "messages[0].content[0]."
    else:
        part = {"type": "video_url", "video_url": {"url": vid, **fields}}
        at = "messages[0].content[0].video_url."
    content = [part, {"type": "text", "text": "What happens?"}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
    r = client.post("/v1/chat/completions", json=body)
    _check(r, field, want, at)
    if field is None:  # the same frames as /qa takes: as many tokens as their timestamps
        qa = {"questions": ["What?"], "mode": "clip", "max_tokens": 1, **fields}
        times = [f["timestamp"] for f in video_qa(client, vid, **qa)[0]["frames"]]
        exact = {"type": "video_url", "video_url": {"url": vid, "timestamps": times}}
        body["messages"][0]["content"][0] = exact
        r2 = client.post("/v1/chat/completions", json=body)
        assert r2.status_code == 200, r2.text
        used = r.json()["usage"]["prompt_tokens"]
        assert used == r2.json()["usage"]["prompt_tokens"] > want * 576


def test_a_clip_over_the_context_names_the_field_set(make_engine) -> None:
    """With 16 images allowed per request, the context (2048 tokens, 576 a frame) is the
    bound a clip crosses: the 400 names the field that decided the frame count."""
    eng = make_engine(max_total_tokens=16384, max_images_per_request=16)
    with app_client(eng, **LIMITS) as c:
        vid = upload_video(c, encode_mp4(rgb_frames(14, seed=11), fps=10)).json()["id"]
        for fields, field in [
            ({"fps": 10}, "fps"),
            ({"num_frames": 14}, "num_frames"),
            ({"fps": 10, "max_frames": 14}, "max_frames"),
            ({"timestamps": [0.1 * i for i in range(14)]}, "timestamps"),
        ]:
            body = {"questions": ["What?"], "mode": "clip", "max_tokens": 4, **fields}
            r = c.post(f"/v1/videos/{vid}/qa", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == field and err["code"] == "clip_too_long", err
            assert "does not fit the model's context" in err["message"], err
            assert "at most 13 frames" in err["message"], err


# ---- the rule, as a property of sample_frame_indices -------------------------------------


def _selections():
    from hypothesis import strategies as st

    maybe = lambda s: st.one_of(st.none(), s)  # noqa: E731
    times = st.lists(st.floats(0, 30, allow_nan=False), min_size=1, max_size=40)
    picker = st.one_of(
        st.builds(dict),
        st.builds(lambda n: {"num_frames": n}, st.integers(1, 80)),
        st.builds(lambda f: {"fps": f}, st.floats(0.01, 120)),
        st.builds(lambda t: {"timestamps": tuple(t)}, times),
    )
    caps = st.fixed_dictionaries(
        {"max_frames": maybe(st.integers(1, 80)), "max_video_tokens": maybe(st.integers(1, 9000))}
    )
    return st.builds(lambda p, c: FrameSelection(**p, **c), picker, caps)


def test_sampling_fits_every_cap_or_names_a_field_the_client_set() -> None:
    """Over random videos, selections, costs and budgets: either the frames fit every cap
    (server frames, max_frames, tokens) and exact counts are kept, or a VideoError names a
    field the client set; fps and the default are never refused for their count."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=400, deadline=None)
    @given(
        st.integers(1, 900),
        st.sampled_from([1.0, 7.5, 10.0, 30.0]),
        _selections(),
        st.integers(1, 64),
        st.integers(1, 700),
        st.integers(0, 1),
        st.one_of(st.none(), st.integers(1, 9000)),
    )
    def check(n, rate, sel, server_frames, per, newline, server_tokens) -> None:
        cost = FrameCost(per, newline)
        duration = n / rate
        try:
            got = sample_frame_indices(
                n, rate, duration, sel, server_frames, None, cost, server_tokens
            )
        except VideoError as e:
            set_fields = {f for f in FIELDS if getattr(sel, f) is not None}
            assert e.field in set_fields or (not set_fields and e.field == "num_frames"), e
            if e.field in ("fps", None) or (e.field == "num_frames" and not set_fields):
                # a rate or the default is refused only when no frame fits the budget
                assert "room for none" in str(e), e
            return
        budget = sel.max_video_tokens or server_tokens
        assert budget is None or cost.tokens(len(got)) <= budget
        assert 1 <= len(got) <= min(server_frames, sel.max_frames or server_frames)
        assert all(0 <= i < n for i in got)
        if sel.timestamps is not None:
            assert len(got) == len(sel.timestamps)
        elif sel.num_frames is not None:
            assert len(got) == min(sel.num_frames, n)
        else:
            assert got == sorted(set(got))

    check()


# ---- the token budget on the video path (LLaVA-OneVision) ---------------------------------


def test_video_token_budget_is_kept_or_refused_by_name(families) -> None:
    """``--max-video-tokens`` with room for 6 frames: fps and the default are thinned to 6
    frames evenly over the clip, a request's ``max_video_tokens`` lowers the budget, exact
    counts over it are refused naming their field; the tokens the video takes in the
    prompt (from ``usage``) are within the budget and equal the frames' count."""
    eng = families["llava-onevision"].make_engine(max_total_tokens=16384)
    per = eng.model.family.video_frame_tokens()
    cap = 6 * per + 1 + per // 2  # 6 frames and the video newline, not 7
    with app_client(eng, **LIMITS, max_video_tokens=cap) as c:
        vid = upload_video(c, encode_mp4(rgb_frames(12, seed=5), fps=10)).json()["id"]

        def chat(fields: dict):
            part = {"type": "video_url", "video_url": {"url": vid, **fields}}
            content = [part, {"type": "text", "text": "What happens?"}]
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
            return c.post("/v1/chat/completions", json=body)

        one = chat({"num_frames": 1}).json()["usage"]["prompt_tokens"]
        evenly = [1, 3, 5, 7, 9, 11]  # num_frames=6's frames
        for fields, frames in [
            ({}, evenly),
            ({"fps": 10}, evenly),  # 12 frames asked, 6 fit
            ({"fps": 10, "max_frames": 4}, [1, 4, 7, 10]),
            ({"fps": 2}, [0, 5, 10]),  # within the budget: as asked
            ({"max_video_tokens": 3 * per + 1}, [2, 6, 10]),
            ({"num_frames": 5}, [1, 3, 6, 8, 10]),
        ]:
            events = video_qa(c, vid, questions=["What?"], mode="clip", max_tokens=1, **fields)
            assert [f["frame_index"] for f in events[0]["frames"]] == frames, fields
            r = chat(fields)
            assert r.status_code == 200, r.text
            used = r.json()["usage"]["prompt_tokens"] - one + per + 1
            assert used == len(frames) * per + 1 <= (fields.get("max_video_tokens") or cap)
        for fields, field, words in [
            ({"num_frames": 7}, "num_frames", f"limit of {cap} video tokens"),
            ({"timestamps": [0.1 * i for i in range(7)]}, "timestamps", "fits 6 frames"),
            ({"max_video_tokens": cap + 1}, "max_video_tokens", f"limit of {cap} video tokens"),
            ({"max_video_tokens": per}, "max_video_tokens", "room for none"),
            ({"num_frames": 4, "max_video_tokens": 3 * per + 1}, "num_frames", "fits 3 frames"),
        ]:
            body = {"questions": ["What?"], "mode": "clip", **fields}
            r = c.post(f"/v1/videos/{vid}/qa", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert words in r.json()["error"]["message"]
            r = chat(fields)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == f"messages[0].content[0].video_url.{field}"


def test_null_frame_fields_on_video_url_are_not_given(client, vid) -> None:
    # {"fps": null} on the video_url sets nothing, so num_frames on the part is not "both"
    part = {"type": "video_url", "video_url": {"url": vid, "fps": None}, "num_frames": 2}
    body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    both = {"type": "video_url", "video_url": {"url": vid, "fps": 1}, "num_frames": 2}
    body["messages"][0]["content"] = [both]
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"].endswith("num_frames"), r.text
