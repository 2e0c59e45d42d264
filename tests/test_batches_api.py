"""``/v1/files`` + ``/v1/batches`` through the official ``openai`` client against live
``mmserve serve`` processes: results equal online answers, bad lines, limits, cancel,
and a SIGKILL in the middle of a batch."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import threading
import time
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.batch import runner
from api.batch.job import TERMINAL, BatchJob, Outputs
from api.batch.lines import prompt_key
from api.batch.runner import BatchManager
from api.endpoints.base import Usage
from api.endpoints.responses import RESPONSES
from api.schemas import ChatCompletionRequest
from api.settings import ServerSettings
from mmserve.types import BACKGROUND, INTERACTIVE
from tests.helpers import spy_on_submitted
from tests.live_server import live_server, live_server_process

MODEL = "tiny"
CHAT = "/v1/chat/completions"
LIMITS = ["--max-batch-file-bytes", "4000000", "--max-batch-lines", "40"]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("batches")
    args = ["--served-model-name", MODEL, "--max-total-tokens", "8192", "--data-dir", str(d)]
    with live_server(model_dir, *args, *LIMITS) as url:
        yield _client(url)


def _chat_body(content: object, max_tokens: int = 4) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def _line(cid: str, body: dict, url: str = CHAT) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def _image(photos: dict[str, bytes], name: str) -> dict:
    url = "data:image/png;base64," + base64.b64encode(photos[name]).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _run(client: openai.OpenAI, lines: list[str], endpoint: str = CHAT, timeout: float = 120):
    f = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")
    assert batch.status == "validating" and batch.input_file_id == f.id
    return _wait(client, batch.id, timeout)


def _wait(client: openai.OpenAI, batch_id: str, timeout: float = 120):
    deadline = time.time() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.time() < deadline, batch
        time.sleep(0.2)


def _records(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(t) for t in client.files.content(file_id).text.splitlines() if t]


def test_batch_answers_equal_online_answers(client, photos) -> None:
    questions = ["What is this?", "What colour is it?"]
    bodies = {
        f"{name}-{k}": _chat_body([_image(photos, name), {"type": "text", "text": q}])
        for name in ("cat.png", "rocket.jpg")
        for k, q in enumerate(questions)
    }
    bodies["text"] = _chat_body("Say something.", 6)
    batch = _run(client, [_line(cid, b) for cid, b in bodies.items()])
    assert batch.status == "completed", batch
    assert batch.request_counts.total == batch.request_counts.completed == len(bodies)
    assert batch.request_counts.failed == 0 and batch.error_file_id is None
    assert batch.completed_at >= batch.in_progress_at >= batch.created_at
    out = _records(client, batch.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(bodies)
    # the second question about each image ran right after the first: the image was cached
    assert batch.usage.input_tokens_details.cached_tokens >= 2 * 576
    assert batch.usage.input_tokens == sum(
        r["response"]["body"]["usage"]["prompt_tokens"] for r in out
    )
    for r in out:
        assert r["error"] is None and r["response"]["status_code"] == 200
        assert r["id"].startswith("batch_req_")
        online = client.chat.completions.create(**bodies[r["custom_id"]])
        body = r["response"]["body"]
        assert r["response"]["request_id"] == body["id"]
        details = body["usage"]["prompt_tokens_details"]
        assert (details["image_tokens"], details["video_tokens"]) == (
            (0, 0) if r["custom_id"] == "text" else (576, 0)
        )
        assert body["choices"][0]["message"]["content"] == online.choices[0].message.content
    info = client.files.retrieve(batch.output_file_id)
    assert info.purpose == "batch_output" and info.bytes > 0


def test_responses_batch(client: openai.OpenAI) -> None:
    body = {"model": MODEL, "input": "Name a fruit.", "max_output_tokens": 5, "temperature": 0}
    batch = _run(client, [_line("r1", body, "/v1/responses")], "/v1/responses")
    assert batch.status == "completed"
    (rec,) = _records(client, batch.output_file_id)
    online = client.responses.create(**body)
    got = rec["response"]["body"]
    assert got["object"] == "response" and got["output"][0]["content"][0]["text"] == (
        online.output_text
    )


def test_malformed_lines_go_to_the_error_file_and_the_rest_run(client) -> None:
    good = _chat_body("Hello.", 2)
    lines = [
        _line("ok-1", good),
        "{not json",
        json.dumps({"method": "POST", "url": CHAT, "body": good}),  # no custom_id
        _line("ok-1", good),  # repeated custom_id
        _line("bad-url", good, "/v1/embeddings"),
        _line("bad-body", {**good, "temperature": 9}),
        _line("bad-image", _chat_body([{"type": "image_url", "image_url": {"url": "img-nope"}}])),
        _line("streamed", {**good, "stream": True}),
        "",
        _line("ok-2", good),
    ]
    batch = _run(client, lines)
    assert batch.status == "completed"
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (9, 2, 7)
    out = _records(client, batch.output_file_id)
    assert sorted(r["custom_id"] for r in out) == ["ok-1", "ok-2"]
    errs = {(r["custom_id"], (r["error"] or {}).get("line")): r for r in _records(
        client, batch.error_file_id
    )}  # fmt: skip
    lines_of = {k[1]: k[0] for k in errs if k[1] is not None}
    assert lines_of == {
        2: None,
        3: None,
        4: "ok-1",
        5: "bad-url",
        6: "bad-body",
        8: "streamed",
    }
    assert errs[("bad-body", 6)]["error"]["param"] == "body.temperature"
    assert "line 6" in errs[("bad-body", 6)]["error"]["message"]
    # a line that validates but fails when run gets the route's answer as its response
    (img,) = [r for (cid, _), r in errs.items() if cid == "bad-image"]
    assert img["error"] is None and img["response"]["status_code"] == 400
    assert img["response"]["body"]["error"]["param"].startswith("messages[0].content[0]")
    assert {e.line for e in batch.errors.data} == set(lines_of)


def test_limits_and_bad_requests_are_400s(client) -> None:
    line = _line("x", _chat_body("Hi.", 1))
    with pytest.raises(openai.BadRequestError) as exc:
        client.files.create(file=("big.jsonl", b"x" * 4000001), purpose="batch")
    assert exc.value.body["param"] == "file" and "4000000" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.files.create(file=("many.jsonl", "\n".join([line] * 41).encode()), purpose="batch")
    assert exc.value.body["code"] == "too_many_lines"
    with pytest.raises(openai.BadRequestError) as exc:
        client.files.create(file=("x.jsonl", line.encode()), purpose="fine-tune")
    assert exc.value.body["param"] == "purpose"
    f = client.files.create(file=("x.jsonl", line.encode()), purpose="batch")
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(
            input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h"
        )
    assert exc.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="1h")
    assert exc.value.body["param"] == "completion_window"
    with pytest.raises(openai.BadRequestError) as exc:  # malformed: never an id
        client.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    assert exc.value.body["param"] == "input_file_id" and "malformed" in exc.value.body["message"]
    with pytest.raises(openai.NotFoundError) as exc:  # well formed, unknown
        client.batches.create(
            input_file_id="file-" + "0" * 24, endpoint=CHAT, completion_window="24h"
        )
    assert exc.value.body["param"] == "input_file_id"
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_cancel_stops_a_batch_and_keeps_finished_lines(client) -> None:
    lines = [_line(f"c{i}", _chat_body(f"Tell me story number {i}.", 24)) for i in range(40)]
    f = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    deadline = time.time() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 2:
        assert time.time() < deadline
        time.sleep(0.05)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    batch = _wait(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    out = _records(client, batch.output_file_id)
    assert 2 <= len(out) == batch.request_counts.completed < 40
    assert len({r["custom_id"] for r in out}) == len(out)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_sigkill_mid_batch_resumes_without_running_a_line_twice(
    model_dir: Path, tmp_path: Path
) -> None:
    args = ["--served-model-name", MODEL, "--max-total-tokens", "8192"]
    args += ["--data-dir", str(tmp_path), "--batch-max-in-flight", "2"]
    bodies = {f"k{i}": _chat_body(f"Count to {i % 7} please.", 10) for i in range(24)}
    with live_server_process(model_dir, *args) as (url, proc):
        c = _client(url)
        f = c.files.create(
            file=("in.jsonl", "\n".join(_line(k, b) for k, b in bodies.items()).encode()),
            purpose="batch",
        )
        batch = c.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        deadline = time.time() + 60
        while c.batches.retrieve(batch.id).request_counts.completed < 4:
            assert time.time() < deadline
            time.sleep(0.02)
        proc.kill()
        proc.wait()
    state = json.loads((tmp_path / "batches" / batch.id / "state.json").read_text())
    assert state["batch"]["status"] == "in_progress"  # killed in the middle
    with live_server(model_dir, *args) as url:
        c = _client(url)
        done = _wait(c, batch.id)
        assert done.status == "completed", done
        out = _records(c, done.output_file_id)
        ids = [r["custom_id"] for r in out]
        assert sorted(ids) == sorted(bodies)  # each exactly once
        assert done.request_counts.completed == 24 and done.error_file_id is None
        for r in out:  # greedy: equal to an uninterrupted (online) answer
            online = c.chat.completions.create(**bodies[r["custom_id"]])
            text = r["response"]["body"]["choices"][0]["message"]["content"]
            assert text == online.choices[0].message.content


def test_cache_order_is_depth_first_over_prompts() -> None:
    """Lines about one image end up adjacent, and so do equal questions under it."""
    rng = random.Random(0)
    bodies = []
    for img in range(5):
        for q in range(4):
            content = [
                {"type": "image_url", "image_url": {"url": f"img-{img:032x}"}},
                {"type": "text", "text": f"question {q}"},
            ]
            bodies.append((img, q, ChatCompletionRequest.model_validate(_chat_body(content))))
    rng.shuffle(bodies)
    ordered = sorted(bodies, key=lambda t: prompt_key(t[2]))
    images = [img for img, _, _ in ordered]
    runs = [images[i] for i in range(len(images)) if i == 0 or images[i] != images[i - 1]]
    assert sorted(runs) == list(range(5))  # each image is one contiguous run
    for img in range(5):
        assert [q for i, q, _ in ordered if i == img] == [0, 1, 2, 3]


def test_batch_requests_reach_the_engine_at_background_priority(make_engine, tmp_path) -> None:
    engine = make_engine(max_total_tokens=8192)
    seen: dict[str, int] = {}
    settings = ServerSettings(served_model_name=MODEL, data_dir=str(tmp_path))
    app = create_app(engine, settings)
    spy_on_submitted(app, lambda req: seen.__setitem__(req.rid, req.priority))
    with TestClient(app) as c:
        lines = [_line(f"k{i}", _chat_body(f"Count to {i}.")) for i in range(3)]
        f = c.post(
            "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", "\n".join(lines))}
        )
        assert f.status_code == 200, f.text
        b = c.post(
            "/v1/batches",
            json={"input_file_id": f.json()["id"], "endpoint": CHAT, "completion_window": "24h"},
        ).json()
        deadline = time.time() + 60
        while c.get(f"/v1/batches/{b['id']}").json()["status"] != "completed":
            assert time.time() < deadline
            time.sleep(0.05)
        assert sorted(seen.values()) == [BACKGROUND] * 3
        online = c.post(CHAT, json=_chat_body("Hello."))
        assert online.status_code == 200
        assert sorted(seen.values()) == [INTERACTIVE] + [BACKGROUND] * 3
    assert (tmp_path / "batches" / b["id"] / "state.json").is_file()  # under --data-dir


def test_lines_wait_for_the_ready_hook(make_engine, tmp_path) -> None:
    """A batch is validated at once but runs no line until ``ready`` returns (what the
    replica ingress does until a replica is healthy, so a batch resumed at start-up
    does not fail its lines while the replicas load); then it completes."""
    engine = make_engine(max_total_tokens=8192)
    seen: list[str] = []
    gate = threading.Event()

    async def ready() -> None:
        while not gate.is_set():
            await asyncio.sleep(0.02)

    app = create_app(engine, ServerSettings(served_model_name=MODEL, data_dir=str(tmp_path)))
    spy_on_submitted(app, lambda req: seen.append(req.rid))
    st = app.state.mm
    st.batches = BatchManager(st, st.batches.files, ready=ready)
    with TestClient(app) as c:
        lines = [_line(f"k{i}", _chat_body(f"Count to {i}.")) for i in range(3)]
        f = c.post(
            "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", "\n".join(lines))}
        ).json()
        body = {"input_file_id": f["id"], "endpoint": CHAT, "completion_window": "24h"}
        bid = c.post("/v1/batches", json=body).json()["id"]

        def status() -> dict:
            return c.get(f"/v1/batches/{bid}").json()

        deadline = time.time() + 60
        while status()["status"] != "in_progress":  # validated before the hook
            assert time.time() < deadline
            time.sleep(0.02)
        time.sleep(0.5)  # unhooked, three 4-token lines take a few ms here
        assert seen == [] and status()["request_counts"]["completed"] == 0
        gate.set()
        while (b := status())["status"] != "completed":
            assert time.time() < deadline
            time.sleep(0.05)
        assert b["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        assert len(seen) == 3


def test_batch_status_moves_follow_the_table(tmp_path: Path) -> None:
    job = BatchJob.new(tmp_path, CHAT, MODEL, "file-" + "0" * 24, None)
    assert job.status == "validating" and not job.ended
    with pytest.raises(ValueError):
        job.move("completed")  # a batch is never completed before it ran
    job.move("in_progress")
    assert job.obj["in_progress_at"] >= job.obj["created_at"]
    job.move("cancelling")
    job.move("cancelled")
    assert job.ended and job.obj["cancelled_at"] is not None
    with pytest.raises(ValueError):
        job.move("cancelling")  # an ended batch never changes
    assert TERMINAL == {"completed", "failed", "expired", "cancelled"}


def _start_batch(c: TestClient, n: int = 3) -> str:
    lines = [_line(f"k{i}", _chat_body(f"Count to {i}.")) for i in range(n)]
    f = c.post(
        "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", "\n".join(lines))}
    ).json()
    body = {"input_file_id": f["id"], "endpoint": CHAT, "completion_window": "24h"}
    return c.post("/v1/batches", json=body).json()["id"]


def _wait_local(c: TestClient, bid: str, until, timeout: float = 60) -> dict:
    deadline = time.time() + timeout
    while not until(b := c.get(f"/v1/batches/{bid}").json()):
        assert time.time() < deadline, b
        time.sleep(0.02)
    return b


def _cancel_while_held(c: TestClient, bid: str, gate: threading.Event, held: str):
    """Cancel ``bid`` from a thread while the runner is held at ``gate`` in status
    ``held``; release the runner once the cancel was answered or the status changed
    (a cancel may wait behind the held IO thread); the cancel's answer."""
    answer: list = []
    t = threading.Thread(target=lambda: answer.append(c.post(f"/v1/batches/{bid}/cancel")))
    t.start()
    deadline = time.time() + 60
    while not answer and c.get(f"/v1/batches/{bid}").json()["status"] == held:
        assert time.time() < deadline
        time.sleep(0.02)
    gate.set()
    t.join(60)
    assert answer, "the cancel was never answered"
    return answer[0]


def _app(make_engine, tmp_path: Path):
    engine = make_engine(max_total_tokens=8192)
    return create_app(engine, ServerSettings(served_model_name=MODEL, data_dir=str(tmp_path)))


def test_a_finalizing_batch_is_not_cancellable_and_completes(
    make_engine, tmp_path, monkeypatch
) -> None:
    """Once every line has run the batch completes: a cancel while it publishes its files
    is answered 409, as for an ended batch, and changes nothing."""
    gate, publishing = threading.Event(), threading.Event()
    publish = BatchManager._publish

    def held(self, job):
        publishing.set()
        gate.wait(60)
        return publish(self, job)

    monkeypatch.setattr(BatchManager, "_publish", held)
    with TestClient(_app(make_engine, tmp_path)) as c:
        bid = _start_batch(c)
        assert publishing.wait(60)
        r = _cancel_while_held(c, bid, gate, "finalizing")
        assert r.status_code == 409 and r.json()["error"]["code"] == "batch_not_cancellable"
        b = _wait_local(c, bid, lambda b: b["status"] in TERMINAL)
    assert b["status"] == "completed" and b["cancelling_at"] is None
    assert b["request_counts"] == {"total": 3, "completed": 3, "failed": 0}


def test_a_cancel_accepted_after_the_last_line_ends_cancelled(
    make_engine, tmp_path, monkeypatch
) -> None:
    """A cancel that arrives after the last line ran but before ``finalizing`` was
    accepted (``cancelling``): the batch ends ``cancelled``, never finalizing."""
    gate, closing = threading.Event(), threading.Event()
    close = Outputs.close

    def held(self):
        closing.set()
        gate.wait(60)
        close(self)

    monkeypatch.setattr(Outputs, "close", held)
    with TestClient(_app(make_engine, tmp_path)) as c:
        bid = _start_batch(c)
        assert closing.wait(60)  # every line has run; the runner closes the files
        r = _cancel_while_held(c, bid, gate, "in_progress")
        assert r.status_code == 200 and r.json()["status"] == "cancelling"
        b = _wait_local(c, bid, lambda b: b["status"] in TERMINAL)
    assert b["status"] == "cancelled", b
    assert b["cancelled_at"] >= b["cancelling_at"] and b["finalizing_at"] is None
    assert b["request_counts"]["completed"] == 3 and b["output_file_id"] is not None


def test_a_failed_periodic_sync_fails_the_batch(make_engine, tmp_path, monkeypatch) -> None:
    """An fsync error while the lines run is not lost: the batch fails (server_error)."""
    monkeypatch.setattr(runner, "SYNC_INTERVAL", 0.0)  # a sync after each line
    calls: list[int] = []
    sync = Outputs.sync

    def flaky(self):
        calls.append(1)
        if len(calls) == 2:  # the first periodic sync (the first is the start's)
            raise OSError("disk full")
        sync(self)

    monkeypatch.setattr(Outputs, "sync", flaky)
    with TestClient(_app(make_engine, tmp_path)) as c:
        bid = _start_batch(c)
        b = _wait_local(c, bid, lambda b: b["status"] in TERMINAL)
    assert len(calls) >= 2
    assert b["status"] == "failed" and b["errors"]["data"][0]["code"] == "server_error"


def test_a_line_is_counted_only_once_its_record_is_written(
    make_engine, tmp_path, monkeypatch
) -> None:
    """A record that could not be written is not counted (and fails the batch)."""
    tried: list[str] = []
    write = Outputs.write

    def flaky(self, record, ok):
        if record.get("custom_id") == "k1" and record.get("response") is not None:
            tried.append("k1")
            raise OSError("disk full")
        write(self, record, ok)

    monkeypatch.setattr(Outputs, "write", flaky)
    with TestClient(_app(make_engine, tmp_path)) as c:
        bid = _start_batch(c)
        b = _wait_local(c, bid, lambda b: b["status"] in TERMINAL)
    assert tried == ["k1"] and b["status"] == "failed"
    d = tmp_path / "batches" / bid
    written = [
        t for n in ("output.jsonl", "errors.jsonl") for t in (d / n).read_text().split("\n") if t
    ]
    counts = b["request_counts"]
    assert counts["completed"] + counts["failed"] == len(written)
    assert all(json.loads(t)["custom_id"] != "k1" for t in written)


def test_recorded_usage_of_a_response_without_usage_is_zero() -> None:
    assert RESPONSES.recorded_usage({}) == Usage(0, 0, 0)
    assert RESPONSES.recorded_usage({"usage": {"input_tokens": 3}}) == Usage(3, 0, 0)


def test_stop_leaves_no_batch_io_thread_behind(make_engine, tmp_path) -> None:
    """start() keeps an IO thread made before it; stop() shuts it down, and IO asked
    for after stop() does not leave a thread running."""
    st = _app(make_engine, tmp_path).state.mm
    m = BatchManager(st, st.batches.files)
    before = set(threading.enumerate())

    async def scenario() -> None:
        await m._on_io(lambda: None)  # before start: a thread start() must keep
        io = m._io
        m.start()
        assert m._io is io
        await m.stop()
        assert await m._on_io(lambda: 7) == 7  # after stop

    asyncio.run(scenario())
    new = [t for t in threading.enumerate() if t not in before]
    for t in new:
        if t.name.startswith("mmserve-batch-io"):
            t.join(5)
            assert not t.is_alive(), t


def test_a_create_whose_state_cannot_be_saved_leaves_no_batch_holding_its_input(
    make_engine, tmp_path, monkeypatch
) -> None:
    """A batch create that fails after claiming its input (its state cannot be written)
    leaves no batch behind: none listed, and the input file can be deleted (not 409)."""

    async def failing(self, job):
        raise OSError("disk full")

    with TestClient(_app(make_engine, tmp_path), raise_server_exceptions=False) as c:
        lines = [_line("k0", _chat_body("Count to 1."))]
        f = c.post(
            "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", lines[0])}
        ).json()
        monkeypatch.setattr(BatchManager, "_save", failing)
        body = {"input_file_id": f["id"], "endpoint": CHAT, "completion_window": "24h"}
        assert c.post("/v1/batches", json=body).status_code == 500
        assert c.get("/v1/batches").json()["data"] == []
        r = c.delete(f"/v1/files/{f['id']}")
        assert r.status_code == 200, r.text
