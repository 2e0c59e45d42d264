"""A failing batch costs only its own requests; repeated failures turn /health 503."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient

from api.app import ServerSettings, create_app

POISON = "poison pill"
NORMAL = ["Tell me about the sky.", "What is a cat?", "Describe a red house."]


def body(text: str, **kw) -> dict:
    return {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 120,
        "temperature": 0,
        "ignore_eos": True,
        **kw,
    }


def poisoned_app(engine):
    """An app whose prefill raises for any batch holding a request about ``POISON``."""
    make, prefill = engine.processor.make_request, engine.runner.prefill
    poison_ids = set()

    def mark(**kw):
        req = make(**kw)
        if any(POISON in str(m.get("content")) for m in kw.get("messages") or []):
            poison_ids.add(req.rid)
        return req

    def failing_prefill(reqs, extends):
        if any(r.rid in poison_ids for r in reqs):
            raise RuntimeError("injected fault")
        return prefill(reqs, extends)

    engine.processor.make_request = mark
    engine.runner.prefill = failing_prefill
    return create_app(engine, ServerSettings(served_model_name="m"))


def accounting(c: TestClient) -> dict:
    stats = c.get("/v1/cache/stats").json()
    assert stats["live_requests"] == 0
    acc = stats["accounting"]
    assert acc["ok"] and acc["running"] == 0, acc
    return acc


@contextmanager
def normal_requests(c: TestClient) -> Iterator[list[str]]:
    """POST each of :data:`NORMAL` from its own thread while the block runs; on leaving,
    wait for them (60 s at most) and fill the yielded list with their answers' texts."""
    answers: dict[int, object] = {}

    def ask(i: int) -> None:
        answers[i] = c.post("/v1/chat/completions", json=body(NORMAL[i]))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(NORMAL))]
    for t in threads:
        t.start()
    texts: list[str] = []
    try:
        yield texts
    finally:  # a failed check in the block still waits for the threads
        for t in threads:
            t.join(timeout=60)
    assert len(answers) == len(NORMAL), "a request never finished"
    texts += [answers[i].json()["choices"][0]["message"]["content"] for i in range(len(NORMAL))]


@pytest.fixture(scope="module")
def baseline(make_engine) -> list[str]:
    with TestClient(create_app(make_engine(), ServerSettings(served_model_name="m"))) as c:
        return [
            c.post("/v1/chat/completions", json=body(t)).json()["choices"][0]["message"]["content"]
            for t in NORMAL
        ]


def test_a_failing_batch_fails_only_its_requests(make_engine, baseline) -> None:
    engine = make_engine()
    with TestClient(poisoned_app(engine)) as c:
        with normal_requests(c) as got:
            deadline = time.time() + 30
            # all three decoding, so the poisoned request's prefill batch holds only itself
            while len(engine.scheduler.running) < len(NORMAL) and time.time() < deadline:
                time.sleep(0.002)
            assert len(engine.scheduler.running) == len(NORMAL), "the requests never all decoded"
            r = c.post("/v1/chat/completions", json=body(POISON))
            err = r.json()["error"]
            assert r.status_code == 500 and err["type"] == "server_error", r.text
            assert "req-" in err["message"] and "RuntimeError" in err["message"]
            # a stream that fails gets an error event, then [DONE]
            with c.stream("POST", "/v1/chat/completions", json=body(POISON, stream=True)) as s:
                events = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert any("error" in json.loads(e) for e in events[:-1]), events
        assert got == baseline
        assert c.get("/health").status_code == 200
        accounting(c)
        assert engine.stats.requests_failed == 2


def test_three_failed_steps_in_a_row_turn_health_503(make_engine) -> None:
    engine = make_engine()
    with TestClient(poisoned_app(engine)) as c:
        for k in range(3):
            assert c.get("/health").status_code == 200, k
            r = c.post("/v1/chat/completions", json=body(POISON, max_tokens=2))
            assert r.status_code == 500
        r = c.get("/health")
        assert r.status_code == 503 and "restart" in r.json()["error"]["message"]
        accounting(c)
        # a step that succeeds again makes the engine healthy
        r = c.post("/v1/chat/completions", json=body(NORMAL[0], max_tokens=2))
        assert r.status_code == 200
        assert c.get("/health").status_code == 200


def test_a_failure_while_sampling_fails_only_that_request(
    make_engine, baseline, monkeypatch
) -> None:
    import mmserve.engine.engine as engine_module

    real = engine_module.sample_token

    def flaky(logits, params, generator):
        if params.seed == 666:
            raise FloatingPointError("injected sampling fault")
        return real(logits, params, generator)

    real_batch = engine_module.sample_batch

    def flaky_batch(rows, params, generators):
        # the batched path fails for the whole batch; the engine then samples row by
        # row, where only the poisoned request fails
        if any(p.seed == 666 for p in params):
            raise FloatingPointError("injected sampling fault")
        return real_batch(rows, params, generators)

    monkeypatch.setattr(engine_module, "sample_token", flaky)
    monkeypatch.setattr(engine_module, "sample_batch", flaky_batch)
    engine = make_engine()
    with TestClient(create_app(engine, ServerSettings(served_model_name="m"))) as c:
        with normal_requests(c) as got:
            r = c.post("/v1/chat/completions", json=body(POISON, seed=666))
            assert r.status_code == 500 and "FloatingPointError" in r.json()["error"]["message"]
        assert got == baseline  # requests sharing its decode batches were not touched
        accounting(c)
