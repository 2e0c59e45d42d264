"""Property-based HTTP fuzzing (schemathesis) from the OpenAPI schema: no input gets a 5xx.

The app runs in a real uvicorn on 127.0.0.1 (in this process, on the shared
model). Examples are bounded per operation, and generated ``max_tokens`` are
capped so that a valid request stays cheap; huge values are covered by
tests/test_api_errors.py.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, Phase, given, settings

from api.app import ServerSettings, create_app
from tests.helpers import MODEL, assert_healthy
from tests.live_server import free_port

MAX_EXAMPLES = 15


@pytest.fixture
def fuzz_server(make_engine):
    """A uvicorn server on 127.0.0.1 for one test; yields its base URL, stops it after."""
    engine = make_engine(max_total_tokens=2048)  # bounds the cost of a long generated prompt
    app = create_app(engine, ServerSettings(served_model_name=MODEL, max_stored_images=8))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(timeout=20)


def call_case(case, url: str) -> None:
    """Send one generated request (with cheap lengths) and check the answer is not a 5xx."""
    if isinstance(case.body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(key), int) and case.body[key] > 8:
                case.body[key] = 8
        if isinstance(case.body.get("n"), int) and case.body["n"] > 4:
            case.body["n"] = 4
    response = case.call(base_url=url, timeout=60)
    what = f"{case.method} {case.path}: {response.status_code} {response.text[:300]}"
    assert response.status_code < 500, what
    if response.status_code >= 400 and response.status_code != 404:
        err = response.json()["error"]  # every refusal is an OpenAI-shaped JSON error
        assert set(err) == {"message", "type", "param", "code"} and err["message"], what


def test_no_input_gets_a_server_error_and_the_server_stays_healthy(fuzz_server) -> None:
    url = fuzz_server
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    seen = []
    for result in schema.get_all_operations():
        op = result.ok()
        seen.append(f"{op.method.upper()} {op.path}")

        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        @given(case=op.as_strategy())
        def run(case) -> None:
            call_case(case, url)

        run()
    assert {
        "POST /v1/chat/completions",
        "POST /v1/images",
        "POST /v1/images/{image_id}/ask",
    } <= set(seen)
    assert len(seen) >= 11, seen
    # and the fuzzing left the server healthy: answering, nothing live, pages accounted for
    with httpx.Client(base_url=url, timeout=60) as client:
        assert_healthy(client)
