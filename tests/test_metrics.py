"""``/metrics`` (Prometheus), ``/v1/cache/stats`` and ``/v1/cache/flush``."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.app import ServerSettings, create_app
from mmserve.vision.inputs import MODALITIES

MODEL = "llava-tiny"


@pytest.fixture()
def client(make_engine):
    engine = make_engine(max_total_tokens=4096)
    with TestClient(create_app(engine, ServerSettings(served_model_name=MODEL))) as c:
        c.engine = engine
        yield c


def scrape(client) -> dict[tuple[str, tuple], float]:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
    }


def ask_image(client, image_id: str, q: str, **kw) -> dict:
    content = [{"type": "image_url", "image_url": {"url": image_id}}, {"type": "text", "text": q}]
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, **kw}
    body["messages"] = [{"role": "user", "content": content}]
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_metrics_count_requests_tokens_cache_and_vision(client, photos) -> None:
    image_id = client.post(
        "/v1/images", files={"file": ("c.png", photos["cat.png"], "image/png")}
    ).json()["id"]
    outs = [ask_image(client, image_id, q) for q in ("One?", "Two?", "Three?")]
    m = scrape(client)
    prompt = sum(o["usage"]["prompt_tokens"] for o in outs)
    cached = sum(o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs)
    assert cached >= 2 * 576
    assert m[("mmserve_requests_total", (("finish_reason", "length"),))] == 3
    by = {k: m[("mmserve_prompt_tokens_total", (("modality", k),))] for k in MODALITIES}
    image = sum(o["usage"]["prompt_tokens_details"]["image_tokens"] for o in outs)
    assert by == {"text": prompt - 3 * 576, "image": 3 * 576, "video": 0}
    assert image == 3 * 576
    assert m[("mmserve_cached_prompt_tokens_total", ())] == cached
    assert m[("mmserve_generation_tokens_total", ())] == 9
    assert m[("mmserve_cache_hit_rate", ())] == pytest.approx(cached / prompt)
    assert m[("mmserve_vision_tower_runs_total", ())] == 1
    assert m[("mmserve_vision_embedding_cache_misses_total", ())] == 1
    assert m[("mmserve_vision_embedding_cache_hits_total", ())] == 0
    assert m[("mmserve_num_requests_running", ())] == 0
    assert m[("mmserve_num_requests_waiting", ())] == 0
    assert m[("mmserve_queue_length", ())] == 0
    assert m[("mmserve_time_to_first_token_seconds_count", ())] == 3
    assert m[("mmserve_time_per_output_token_seconds_count", ())] == 3
    assert m[("mmserve_e2e_request_latency_seconds_count", ())] == 3
    assert m[("mmserve_time_to_first_token_seconds_sum", ())] > 0
    used = m[("mmserve_kv_pages", (("state", "used"),))]
    free = m[("mmserve_kv_pages", (("state", "free"),))]
    evictable = m[("mmserve_kv_pages", (("state", "evictable"),))]
    # disjoint states that add up to the pool; at rest no request holds a page, so
    # every page not free is an unlocked (evictable) tree page
    assert used + evictable + free == m[("mmserve_kv_pool_pages", ())] == 4096
    assert used == 0 and evictable > 576
    assert m[("mmserve_radix_tree_nodes", ())] >= 2

    stats = client.get("/v1/cache/stats").json()
    assert stats["prompt_tokens"] == prompt and stats["cached_tokens"] == cached
    assert stats["cache_hit_rate"] == pytest.approx(cached / prompt)
    assert stats["tree_nodes"] == m[("mmserve_radix_tree_nodes", ())]
    assert stats["used_pages"] == used and stats["evictable_pages"] == evictable
    assert stats["vision_tower_images"] == 1 and stats["queue_length"] == 0
    assert stats["requests_by_finish_reason"] == {"length": 3}
    assert stats["ttft_seconds"]["count"] == 3 and stats["ttft_seconds"]["mean"] > 0
    assert stats["accounting"] == {
        "ok": True,
        "free": free,
        "tree": evictable,
        "running": 0,
        "total": 4096,
    }
    assert stats["stored_images"] == 1
    json.dumps(stats)  # plain JSON


def test_flush_drops_the_tree_only_when_idle(client, photos) -> None:
    image_id = client.post(
        "/v1/images", files={"file": ("r.jpg", photos["rocket.jpg"], "image/jpeg")}
    ).json()["id"]
    ask_image(client, image_id, "First?")
    before = client.get("/v1/cache/stats").json()
    assert before["tree_pages"] > 576
    body = {
        "model": MODEL,
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
        "messages": [{"role": "user", "content": "Go on forever."}],
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the request is live now
        busy = client.post("/v1/cache/flush")
        assert busy.status_code == 409, busy.text
        assert busy.json()["error"]["code"] == "requests_running"
        # a live request holds pages: "used" now, not counted again as evictable or free
        live = client.get("/v1/cache/stats").json()
        assert live["used_pages"] >= 1 and live["evictable_pages"] > 576
        assert live["used_pages"] + live["evictable_pages"] + live["free_pages"] == 4096
    # leaving the stream early aborted the request; wait for the engine to see it
    for _ in range(200):
        stats = client.get("/v1/cache/stats").json()
        if stats["live_requests"] == 0:
            break
    assert stats["live_requests"] == 0 and stats["accounting"]["ok"]
    assert stats["requests_by_finish_reason"] == {"length": 1, "abort": 1}
    r = client.post("/v1/cache/flush")
    assert r.status_code == 200, r.text
    assert r.json()["flushed"] is True and r.json()["freed_pages"] >= before["tree_pages"]
    after = client.get("/v1/cache/stats").json()
    assert after["free_pages"] == after["pool_pages"] and after["tree_nodes"] == 0
    again = ask_image(client, image_id, "First?")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert client.get("/v1/cache/stats").json()["vision_tower_images"] == 2
