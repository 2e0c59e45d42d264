"""``cache_salt`` (issue 42): requests with different salts share no cached state (prefix
KV, image features, tier pages); the same salt shares as no salt does."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from api.app import ServerSettings, create_app
from mmserve.cache.salt import combine, namespace, salted_ids, salted_image_key
from tests.helpers import (
    MODEL,
    chat_json,
    data_url,
    greedy,
    image_part,
    png_bytes,
    tower_runs,
    user,
)


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_total_tokens=8192)


@pytest.fixture()
def client(engine):
    engine.flush_cache()
    with TestClient(create_app(engine, ServerSettings(served_model_name=MODEL))) as c:
        yield c


def _photo(seed: int) -> str:
    im = Image.new("RGB", (48, 40), (seed * 37 % 256, seed * 91 % 256, seed * 13 % 256))
    return data_url(png_bytes(im))


def _ask(client, url: str, text: str = "What is in this image? Answer at length.", **kw):
    content = [image_part(url), {"type": "text", "text": text}]
    return chat_json(client, content, **kw)


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_salted_ids_keep_length_and_differ_across_salts() -> None:
    ids = [1, 2, 3, 1, -5, -(2**63)]
    a, b = salted_ids(ids, namespace("a")), salted_ids(ids, namespace("b"))
    assert len(a) == len(ids) and len(set(a)) == len(set(ids))
    assert a == salted_ids(ids, namespace("a"))  # deterministic: restarts share
    assert not set(a) & set(b) and not set(a) & set(ids)
    assert all(x < 0 for x in a)  # never a text id of an unsalted key
    assert salted_ids(ids, 0) == ids and namespace("") == 0
    key = bytes(range(16))
    assert salted_image_key(key, "") == key and salted_image_key(key, "a") != key
    assert len(salted_image_key(key, "a")) == 16
    # the tenant is part of the salt: two tenants sending the same cache_salt differ
    assert combine("t1", "s") != combine("t2", "s") != combine(None, "s") == "s"


def test_two_salts_share_nothing_one_salt_shares(client, engine) -> None:
    url = _photo(1)
    first = _ask(client, url, cache_salt="alice")
    assert _cached(first) == 0
    runs = tower_runs(client)
    other = _ask(client, url, cache_salt="bob")
    assert _cached(other) == 0  # no prefix of alice's: not even the template's
    assert tower_runs(client) == runs + 1  # the image encoded again, for bob
    runs = tower_runs(client)
    again = _ask(client, url, cache_salt="alice")
    assert _cached(again) > 0 and _cached(again) >= first["usage"]["prompt_tokens"] - 16
    assert tower_runs(client) == runs  # alice's features were cached
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    # unsalted requests share neither with a salt
    plain = _ask(client, url)
    assert _cached(plain) == 0 and tower_runs(client) == runs + 1


def test_no_salt_shares_as_before(client, engine) -> None:
    url = _photo(2)
    a = _ask(client, url)
    runs = tower_runs(client)
    b = _ask(client, url)
    assert _cached(b) > 0 and tower_runs(client) == runs
    assert a["choices"][0]["message"] == b["choices"][0]["message"]


def test_same_salt_hit_rate_equals_unsalted(client) -> None:
    url = _photo(3)
    _ask(client, url, text="first question")
    plain = _ask(client, url, text="second question")
    _ask(client, url, text="first question", cache_salt="s1")
    salted = _ask(client, url, text="second question", cache_salt="s1")
    assert _cached(salted) == _cached(plain) > 0
    assert salted["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


def test_text_prefix_not_shared_across_salts(client) -> None:
    text = "A long shared system preamble. " * 12
    chat_json(client, text + "one", cache_salt="x")
    assert _cached(chat_json(client, text + "two", cache_salt="y")) == 0
    assert _cached(chat_json(client, text + "two", cache_salt="x")) > 0


@pytest.mark.parametrize("bad", ["", "x" * 257, 5, None])
def test_bad_salt_is_a_400_naming_it(client, bad) -> None:
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "cache_salt": bad},
    )
    if bad is None:
        assert r.status_code == 200
        return
    assert r.status_code == 400 and "cache_salt" in r.text


def test_salt_on_responses_and_ask(client, engine) -> None:
    url = _photo(4)
    body = {"model": MODEL, "max_output_tokens": 2, "temperature": 0}
    content = [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": "hi"}]
    inp = [{"role": "user", "content": content}]
    r1 = client.post("/v1/responses", json={**body, "input": inp, "cache_salt": "a"})
    assert r1.status_code == 200, r1.text
    r2 = client.post("/v1/responses", json={**body, "input": inp, "cache_salt": "b"})
    assert r2.json()["usage"]["input_tokens_details"]["cached_tokens"] == 0
    r3 = client.post("/v1/responses", json={**body, "input": inp, "cache_salt": "a"})
    assert r3.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0


# ---- the disk tier: salted pages across a restart, prompt_cache_retention ---------------


def _gen(eng, img, salt: str = "", retention: str = ""):
    req = eng.processor.make_request(
        messages=user(None, "Describe it."), images=[img], params=greedy(4), cache_salt=salt
    )
    if retention:
        req = replace(req, prompt_cache_retention=retention)
    out = eng.generate([req])[0]
    eng.scheduler.check_accounting()
    return out


def test_salted_pages_survive_a_restart_only_for_their_salt(
    make_engine, photos, tmp_path: Path
) -> None:
    first = make_engine(kv_disk_dir=str(tmp_path))
    img = first.processor.prepare_image(next(iter(photos.values())))
    a = _gen(first, img, "alice")
    assert first.close() > 0  # shutdown writes the tree's (salted) pages
    second = make_engine(kv_disk_dir=str(tmp_path))
    other = _gen(second, img, "bob")
    assert other.cached_tokens == 0 and other.vision_tower_runs == 1
    assert second.cache_stats()["tier_disk_hit_tokens"] == 0
    plain = _gen(second, img)
    assert plain.cached_tokens == 0 and second.cache_stats()["tier_disk_hit_tokens"] == 0
    again = _gen(second, img, "alice")
    assert again.cached_tokens == again.prompt_tokens - 1  # from disk, alice's salt
    assert again.output_ids == a.output_ids
    second.close()


def test_retention_24h_writes_through_to_disk(make_engine, photos, tmp_path: Path) -> None:
    eng = make_engine(kv_disk_dir=str(tmp_path))
    img = eng.processor.prepare_image(next(iter(photos.values())))
    _gen(eng, img, "x")
    eng.tiers.disk.flush(30)
    assert len(eng.tiers.disk) == 0  # in_memory (default): nothing written while cached
    r = _gen(eng, img, "y", retention="24h")
    eng.tiers.disk.flush(30)
    pages = r.prompt_tokens // eng.config.page_size
    assert len(eng.tiers.disk) >= pages  # the whole prompt is on disk at once
    eng.close(timeout=30)


def test_write_through_policy_leaves_the_cache_on_disk_without_a_shutdown(
    make_engine, photos, tmp_path: Path
) -> None:
    """``--kv-write-policy write_through``: every request's pages are queued for disk as
    it ends, so an engine that is never closed (killed) leaves a warm disk tier."""
    with pytest.raises(ValueError, match="write_through needs --kv-disk-dir"):
        make_engine(kv_write_policy="write_through")
    first = make_engine(kv_disk_dir=str(tmp_path), kv_write_policy="write_through")
    img = first.processor.prepare_image(next(iter(photos.values())))
    a = _gen(first, img)
    first.tiers.disk.flush(30)
    assert len(first.tiers.disk) >= a.prompt_tokens // first.config.page_size
    second = make_engine(kv_disk_dir=str(tmp_path))  # ``first`` is not closed
    again = _gen(second, img)
    assert again.cached_tokens == again.prompt_tokens - 1 and again.output_ids == a.output_ids
    assert second.cache_stats()["tier_disk_hit_tokens"] > 0
    second.close(timeout=30)
    first.close(timeout=30)


def test_retention_24h_without_disk_tier_is_a_400(client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = client.post("/v1/chat/completions", json={**body, "prompt_cache_retention": "24h"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_retention"
    assert "--kv-disk-dir" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={**body, "prompt_cache_retention": "1h"})
    assert r.status_code == 400 and "prompt_cache_retention" in r.text
    r = client.post("/v1/chat/completions", json={**body, "prompt_cache_retention": "in_memory"})
    assert r.status_code == 200
    r = client.post(
        "/v1/responses",
        json={"model": MODEL, "input": "hi", "max_output_tokens": 1, "prompt_cache_key": "k"},
    )
    assert r.status_code == 200, r.text
