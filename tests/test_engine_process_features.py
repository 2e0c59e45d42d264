"""The API process's mirror of the engine process's embedding-cache keys (issue 41): an
image whose features the engine holds is neither decoded nor preprocessed again in the API
process and crosses by key (no pixels), with the same answers; a key the engine dropped
while the mirror still named it (the mirror lags by a message) still answers correctly:
the engine answers a miss and the front end sends the pixels."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterator

import pytest
import torch
from fastapi.testclient import TestClient

from api.app import ServerSettings, create_app, start_engine_process
from mmserve.vision.embedding_cache import EmbeddingCache, FeatureKeys
from tests.helpers import MODEL, chat_json, data_url, image_part, video_qa
from tests.live_server import app_client, pid_alive
from tests.videos import encode_mp4, rgb_frames


def test_the_mirror_follows_the_caches_keys_through_puts_evictions_and_clears() -> None:
    """Random puts (sizes past the capacity evict), clears and reads of the change record
    at random points: the mirror, fed only the records, names exactly the cached keys."""
    rng = random.Random(7)
    cache, mirror = EmbeddingCache(capacity_bytes=4096), FeatureKeys()
    cache.record_changes()
    for _ in range(2000):
        op = rng.random()
        if op < 0.02:
            cache.clear()
        else:
            key = bytes([rng.randrange(40)])
            cache.put(key, torch.zeros(rng.choice((64, 256, 600, 1200))))  # float32: x4 bytes
        if rng.random() < 0.3:
            changes = cache.take_changes()
            if changes is not None:
                mirror.apply(*changes)
                assert set(mirror) == set(cache._store.keys())
    changes = cache.take_changes()
    if changes is not None:
        mirror.apply(*changes)
    assert set(mirror) == set(cache._store.keys()) and len(mirror) > 0
    assert cache.take_changes() is None  # nothing since


class Spy:
    """Counts the front end's preprocessing and records the images of each request the
    client sends the engine process (as they cross)."""

    def __init__(self, front, process) -> None:
        self.preprocessed = 0
        self.sent: list[list] = []
        real_pre, real_send = front.processor._preprocess, process._send

        def preprocess(*a, **kw):
            self.preprocessed += 1
            return real_pre(*a, **kw)

        def send(msg: tuple) -> None:
            if msg[0] == "add":
                self.sent.append([s.image for s in msg[1].spans])
            real_send(msg)

        front.processor._preprocess = preprocess
        process._send = send


ONE = "Describe it."
TWO = "Compare them."


@pytest.fixture(scope="module")
def split(make_engine, photos) -> Iterator[tuple]:
    """``(client, process, spy, want)``: the process-split app on a fresh tiny engine's
    settings, and ``want`` the in-process server's answers to :func:`questions`."""
    engine = make_engine(max_total_tokens=4096)
    with app_client(engine, engine_process=False) as c:
        want = [_answer(c, q) for q in questions(photos)]
    config = dataclasses.replace(engine.config, dtype=engine.describe()["dtype"])
    front, process = start_engine_process(config, restarts=0)
    spy = Spy(front, process)
    try:
        app = create_app(front, ServerSettings(served_model_name=MODEL), process=process)
        with TestClient(app) as c:
            yield c, process, spy, want
    finally:
        process.stop()
    assert not pid_alive(process.pid)


def questions(photos) -> list[list[dict]]:
    """The astronaut alone, then the cat and the astronaut (data URLs)."""
    astronaut, cat = data_url(photos["astronaut.png"]), data_url(photos["cat.png"])
    return [
        [image_part(astronaut), {"type": "text", "text": ONE}],
        [image_part(cat), image_part(astronaut), {"type": "text", "text": TWO}],
    ]


def _answer(c, content) -> str:
    return chat_json(c, content, max_tokens=8)["choices"][0]["message"]["content"]


def _flushed(c, process) -> None:
    """The engine's caches emptied, and the mirror told so."""
    assert c.post("/v1/cache/flush").status_code == 200
    _wait_for_keys(process, 0)


def _wait_for_keys(process, n: int) -> None:
    deadline = time.time() + 10
    while len(process.feature_keys) != n:  # the step's features message
        assert time.time() < deadline, (len(process.feature_keys), n)
        time.sleep(0.02)


def test_a_repeated_image_crosses_by_key_and_answers_the_same(split, photos) -> None:
    c, process, spy, want = split
    one, two = questions(photos)
    _flushed(c, process)
    pre, resent = spy.preprocessed, process.resent
    assert _answer(c, one) == want[0]
    assert spy.preprocessed == pre + 1 and spy.sent[-1][0].pixels is not None
    _wait_for_keys(process, 1)
    tower = c.get("/v1/cache/stats").json()["vision_tower_images"]
    assert _answer(c, one) == want[0]  # again: by key, neither decoded nor preprocessed
    assert spy.preprocessed == pre + 1
    assert [im.pixels for im in spy.sent[-1]] == [None]
    assert _answer(c, two) == want[1]  # the cat is new: only its pixels cross
    assert spy.preprocessed == pre + 2
    assert [im.pixels is None for im in spy.sent[-1]] == [False, True]
    _wait_for_keys(process, 2)
    assert _answer(c, two) == want[1]
    assert spy.preprocessed == pre + 2 and all(im.pixels is None for im in spy.sent[-1])
    # an uploaded image's id: the same key, so by key as well
    img = c.post("/v1/images", files={"file": ("a.png", photos["astronaut.png"])})
    assert _answer(c, [image_part(img.json()["id"]), {"type": "text", "text": ONE}]) == want[0]
    assert spy.preprocessed == pre + 2 and spy.sent[-1][0].pixels is None
    stats = c.get("/v1/cache/stats").json()
    assert stats["vision_tower_images"] == tower + 1  # the cat only
    assert process.resent == resent


def test_a_key_the_engine_dropped_still_answers_correctly(split, photos) -> None:
    """The engine's cache is flushed, then the mirror is made to name the keys again (as a
    mirror that has not read the engine's message yet would): the request crosses by key,
    the engine answers a miss, the front end prepares the pixels (from the bytes it kept)
    and sends it again; the answer is the in-process one, the tower runs once more."""
    c, process, spy, want = split
    two = questions(photos)[1]
    assert _answer(c, two) == want[1]
    _wait_for_keys(process, 2)
    keys = set(process.feature_keys)
    _flushed(c, process)
    process.feature_keys.apply(keys, [], False)  # a mirror one message behind
    pre, resent = spy.preprocessed, process.resent
    tower = c.get("/v1/cache/stats").json()["vision_tower_images"]
    assert _answer(c, two) == want[1]
    assert process.resent == resent + 1
    first, again = spy.sent[-2], spy.sent[-1]
    assert all(im.pixels is None for im in first)  # by key: missed
    assert all(im.pixels is not None for im in again)  # then with pixels
    assert spy.preprocessed == pre + 2  # made once each, for the resend
    stats = c.get("/v1/cache/stats").json()
    assert stats["vision_tower_images"] == tower + 2
    assert stats["live_requests"] == 0 and stats["accounting"]["ok"], stats
    _wait_for_keys(process, 2)
    assert set(process.feature_keys) == keys
    assert _answer(c, two) == want[1] and process.resent == resent + 1  # held again


def test_a_video_asked_again_sends_its_frames_by_key(split) -> None:
    """Video frames are preprocessed as they are decoded (no bytes to make them from
    again): asked again, they cross by key while their pixels stay in the API process,
    and the answers are the first ones."""
    c, process, spy, _ = split
    _flushed(c, process)
    up = c.post("/v1/videos", files={"file": ("v.mp4", encode_mp4(rgb_frames(4)))})
    assert up.status_code == 200, up.text
    body = {"questions": ["What is this?", "Colors?"], "num_frames": 4, "max_tokens": 3}

    def answers() -> list[str]:
        events = video_qa(c, up.json()["id"], **body)
        return [e["text"] for e in sorted(events[1:-1], key=lambda e: e["question_index"])]

    n = len(spy.sent)
    first = answers()
    assert all(im.pixels is not None for im in spy.sent[n])  # the first request's frames
    _wait_for_keys(process, 4)
    tower, n = c.get("/v1/cache/stats").json()["vision_tower_images"], len(spy.sent)
    assert answers() == first
    assert len(spy.sent) > n and all(im.pixels is None for sent in spy.sent[n:] for im in sent)
    assert c.get("/v1/cache/stats").json()["vision_tower_images"] == tower
