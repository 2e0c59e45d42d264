"""``mmserve serve --replicas 2``: engine replicas on Ray Serve behind one endpoint.

The end-to-end tests start real servers (``tests/live_server.py``), each with its own
Ray instance on loopback: two tiny replicas with the cache router, then two with
round-robin, next to a single-process server. They check that answers equal the
single-process server's (greedy), uploads work on both replicas, the cache router's
hit rate on an interleaved workload is that of one replica while round-robin's is
lower, the vision tower runs once per image, stats/metrics/health/flush cover every
replica, a killed replica (mid-request, idle, between two requests) costs no hung
request and comes back, and a burst gets 503 with Retry-After; then two replicas (pow2)
sharing one encoder (``--encoders 1``): one-process answers with one tower run per
image, the encoder store's bound, a killed encoder, files + batches surviving a
replica's death, and a replaced replica getting known images' features from the
encoder (no tower run); last, a SIGKILL of the whole process mid-batch and a restart
that resumes the batch without rerunning finished lines. The unit tests (prefix tree,
routers, bounded calls, feature store, feature source, front end, flags) need no Ray
instance.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

pytest.importorskip("ray.serve", reason='needs Ray Serve: pip install -e ".[replicas]"')

from api.cli import build_parser, replica_settings_from_args
from benchmarks import experiments as bench
from benchmarks import workloads
from mmserve.config import EngineConfig
from mmserve.fleet.prefix_tree import PrefixTree
from mmserve.fleet.settings import ReplicaSettings
from mmserve.frontend.frontend import FrontEnd, load_frontend_model
from mmserve.types import SamplingParams
from mmserve.vision.inputs import MODALITIES
from tests.helpers import serve_help_defaults
from tests.live_server import (
    child_pids,
    cmdline,
    live_server,
    live_server_process,
    metric,
    wait_gone,
)
from tests.videos import encode_mp4, rgb_frames

MODEL = "tiny"
RAY_ARGS = ("--replicas", "2", "--cpus-per-replica", "0.5", "--served-model-name", MODEL)
#: Ray, two replicas and an ingress on two shared cores: start-up takes a while.
START_TIMEOUT = 300
#: The interleaved workload of the hit-rate tests (`python -m benchmarks replicas`, "ci" scale).
WORKLOAD = dict(k=3, m=3, c=2, t=3, max_tokens=4)
CONCURRENCY = 3


# ---- helpers -------------------------------------------------------------------------


def png(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def user(*parts: str | dict) -> dict:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return {"role": "user", "content": content}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(url: str, messages: list[dict], **kw) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0, **kw}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def streamed(url: str, messages: list[dict], **kw) -> tuple[str, list[dict]]:
    """The concatenated streamed text and every event."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0}
    body.update(kw, stream=True)
    events = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    text = "".join(c["delta"].get("content") or "" for e in parsed for c in e.get("choices", []))
    return text, parsed


def stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/cache/stats", timeout=60).json()


def upload(url: str, data: bytes, kind: str = "images") -> str:
    r = httpx.post(f"{url}/v1/{kind}", files={"file": ("f", data, "application/octet-stream")})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def flush(url: str) -> None:
    for _ in range(100):
        r = httpx.post(f"{url}/v1/cache/flush", timeout=60)
        if r.status_code == 200:
            return
        time.sleep(0.1)
    raise AssertionError(f"flush refused: {r.text}")


def wait_for(cond, timeout: float, what: str, every: float = 0.5):
    deadline = time.time() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.time() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(every)


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def start_batch(client: openai.OpenAI, bodies: dict[str, dict]):
    """Upload ``bodies`` (custom_id -> chat completion body) and create their batch."""
    lines = (
        json.dumps({"custom_id": c, "method": "POST", "url": "/v1/chat/completions", "body": b})
        for c, b in bodies.items()
    )
    f = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    return client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def completed_batch(client: openai.OpenAI, batch_id: str, total: int):
    """The batch once it ends, asserting it completed all ``total`` lines."""

    def ended():
        b = client.batches.retrieve(batch_id)
        return b if b.status in ("completed", "failed", "cancelled", "expired") else None

    b = wait_for(ended, 300, "the batch to finish")
    assert b.status == "completed", b
    counts = b.request_counts
    assert counts.total == counts.completed == total and counts.failed == 0, counts
    return b


def run_workload(url: str) -> dict:
    """The interleaved workload from cold caches; the benchmark's figures."""
    flush(url)
    wl = workloads.interleaved(**WORKLOAD)
    res = bench.run_setup(url, MODEL, wl, CONCURRENCY)
    assert res["errors"] == 0, res["error_messages"]
    return res


class FakeReplica:
    """What the cache router reads of a Ray Serve ``RunningReplica``: its id, capacity,
    node and an empty queue."""

    def __init__(self, uid: str, dep: object) -> None:
        from ray.serve._private.common import ReplicaID

        self.replica_id = ReplicaID(uid, dep)
        self.max_ongoing_requests = 100
        self.node_id, self.availability_zone = "node", None
        self.multiplexed_model_ids: set[str] = set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


# ---- servers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single(model_dir: Path):
    """The single-process server (no Ray): the reference."""
    with live_server(model_dir, "--served-model-name", MODEL) as url:
        yield url


@pytest.fixture(scope="module")
def single_workload(single: str) -> dict:
    """The interleaved workload on one engine."""
    return run_workload(single)


# ---- no Ray instance needed ----------------------------------------------------------------


def test_prefix_tree_matches_inserts_and_trims_least_recently_used() -> None:
    pt = PrefixTree(max_tokens=20)
    assert pt.match([1, 2, 3]) == 0
    assert pt.insert([1, 2, 3, 4, 5]) == 0
    assert pt.insert([1, 2, 3, 9]) == 3  # splits the edge after 3
    assert (pt.match([1, 2, 3, 4, 5, 6]), pt.match([1, 2, 3, 9]), pt.match([1, 7])) == (5, 4, 1)
    assert pt.size == 6 and pt.node_count() == 3
    before = pt.size
    assert pt.match([1, 2, 3, 4]) == 4 and pt.size == before  # matching changes nothing
    pt.insert([-5, -6, -7, -8])  # image pseudo-ids are plain (negative) ints
    assert pt.match([-5, -6, -7, 1]) == 3
    pt.insert([1, 2, 3, 4, 5])  # refreshes 1..5: [1, 2, 3, 9] is now the oldest leaf
    pt.insert(list(range(100, 112)))  # 22 tokens > 20: trimmed to 18
    assert pt.size <= 18
    assert pt.match([1, 2, 3, 9]) == 3  # the least recently used leaf went first
    assert pt.match(list(range(100, 112))) == 12
    pt.clear()
    assert pt.size == 0 and pt.match([1, 2]) == 0


def test_replica_flags_parse_with_defaults_from_the_dataclass() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--replicas",
            "3",
            "--ray-address",
            "10.0.0.1:6379",
            "--gpus-per-replica",
            "0.5",
            "--cpus-per-replica",
            "0.25",
            "--replica-router",
            "round_robin",
        ]
    )
    rs = replica_settings_from_args(args)
    assert rs == ReplicaSettings(
        replicas=3,
        ray_address="10.0.0.1:6379",
        gpus_per_replica=0.5,
        cpus_per_replica=0.25,
        replica_router="round_robin",
    )
    assert rs.uses_ray and rs.gpus("cpu") == 0.5
    default = replica_settings_from_args(build_parser().parse_args(["serve"]))
    assert default == ReplicaSettings() and not default.uses_ray  # single process, no Ray
    assert default.gpus("cuda") == 1.0 and default.gpus("cpu") == 0.0
    assert ReplicaSettings(ray_address="auto").uses_ray
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--replica-router", "random"])
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        ReplicaSettings(replicas=0).validate()
    shown = serve_help_defaults()
    for f in dataclasses.fields(ReplicaSettings):  # every field a flag, default shown
        flag = "--" + f.name.replace("_", "-")
        assert shown.get(flag) == str(getattr(ReplicaSettings(), f.name)), (flag, shown.get(flag))


def test_front_end_without_weights_builds_the_engines_requests(make_engine, model_dir) -> None:
    eng = make_engine()
    front = FrontEnd(EngineConfig(model_path=str(model_dir)), load_frontend_model(model_dir))
    assert front.model.vision is None and front.max_context == eng.max_context
    assert front.processor.kv_capacity_tokens == eng.pool.size_tokens
    red, blue = png((200, 10, 10)), png((10, 10, 200), (64, 64))
    cases = [
        ([{"role": "user", "content": "Hello there."}], []),
        (
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q?"}]},
                {"role": "assistant", "content": "A red square."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And?"}]},
            ],
            [red, blue],
        ),
    ]
    params = SamplingParams(max_tokens=5)
    for messages, imgs in cases:
        proc = eng.processor
        a = proc.make_request(
            messages=messages, images=[proc.prepare_image(b) for b in imgs], params=params
        )
        fp = front.processor
        b = fp.make_request(
            messages=messages, images=[fp.prepare_image(x) for x in imgs], params=params
        )
        assert a.input_ids == b.input_ids
        assert [(s.start, s.length, s.image.key, s.image.mode) for s in a.spans] == [
            (s.start, s.length, s.image.key, s.image.mode) for s in b.spans
        ]
    assert front.model.eos_token_ids == eng.model.eos_token_ids
    assert front.model.never_sample_ids == eng.model.never_sample_ids


def test_cache_router_policy() -> None:
    from ray.serve._private.common import (
        DeploymentHandleSource,
        DeploymentID,
        ReplicaID,
        RequestMetadata,
    )
    from ray.serve.request_router import PendingRequest

    from mmserve.fleet.protocol import ControlCall, ReplicaRequest
    from mmserve.fleet.registry import find_router
    from mmserve.fleet.router import CacheAwareRouter

    dep = DeploymentID(name="EngineReplica", app_name="unit")

    def pending(ids: list[int], rid: str, avoid: str | None = None) -> PendingRequest:
        md = RequestMetadata(request_id=rid, internal_request_id=rid)
        rr = ReplicaRequest(rid, ids, [], SamplingParams(), avoid=avoid)
        return PendingRequest(args=[rr], kwargs={}, metadata=md)

    async def main() -> None:
        router = CacheAwareRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(balance_abs_threshold=2, balance_rel_threshold=1.5)
        assert find_router("unit", "EngineReplica") is router
        a, b = FakeReplica("a", dep), FakeReplica("b", dep)
        router.update_replicas([a, b])
        cands = [a, b]

        async def route(ids: list[int], rid: str, avoid: str | None = None) -> str:
            pr = pending(ids, rid, avoid)
            ranked = await router.choose_replicas(cands, pr)
            chosen = ranked[0][0]
            router.on_request_routed(pr, chosen.replica_id, None)
            return chosen.replica_id.unique_id

        system = list(range(10))
        img1 = [-(i + 1) for i in range(50)]
        img2 = [-(i + 100) for i in range(50)]
        # a new image goes to the least-loaded replica; questions about it follow it
        first = await route(system + img1 + [7, 8], "q1")
        assert await route(system + img1 + [9, 9], "q2") == first
        other = "b" if first == "a" else "a"
        # another new image: the other replica is less loaded now
        assert await route(system + img2 + [7], "q3") == other
        assert await route(system + img2 + [5], "q4") == other
        snap = router.snapshot()
        assert snap["by_reason"] == {"no_match": 2, "prefix": 2}
        assert snap["replicas"][first]["in_flight"] == 2
        # finished requests leave the load; uneven load beyond the thresholds wins over
        # the cached prefix
        for rid in ("q3", "q4"):
            router.on_request_completed(ReplicaID(other, dep), rid)
        assert await route(system + img1 + [1], "q5") == first  # 3 vs 0: not > 1.5x yet
        assert await route(system + img1 + [2], "q6") == other  # 3 > 0 + 2: by load
        assert router.snapshot()["by_reason"]["load"] == 1
        # a retry avoids the replica that died serving it
        assert await route(system + img1 + [3], "q7", avoid=first) == other
        # a control call goes to its target only
        call = PendingRequest(
            args=[ControlCall("stats", target=other)],
            kwargs={},
            metadata=RequestMetadata(request_id="c", internal_request_id="c"),
        )
        ranked = await router.choose_replicas(cands, call)
        assert [[r.replica_id.unique_id for r in rank] for rank in ranked] == [[other]]
        # a call for a replica that is gone gets no replica, and Ray Serve is told to back
        # off before asking again (else its routing loop spins and starves every request)
        gone = PendingRequest(
            args=[ControlCall("health", target="gone")],
            kwargs={},
            metadata=RequestMetadata(request_id="g", internal_request_id="g"),
        )
        assert not gone.routing_context.should_backoff
        assert await router.choose_replicas(cands, gone) == []
        assert gone.routing_context.should_backoff
        # a dead replica's tree goes; the survivor takes its questions
        router.on_replica_actor_died(ReplicaID(first, dep))
        assert not router.snapshot()["replicas"][first]["alive"]
        cands.remove(a if first == "a" else b)
        assert await route(system + img1 + [4], "q8") == other

    asyncio.run(main())


class HungCall:
    """A Ray Serve response (or response generator) that never answers."""

    def __init__(self) -> None:
        self.cancelled = False

    def __await__(self):
        return asyncio.get_running_loop().create_future().__await__()

    def __aiter__(self) -> HungCall:
        return self

    async def __anext__(self) -> object:
        await asyncio.get_running_loop().create_future()

    def cancel(self) -> None:
        self.cancelled = True


class HungHandle:
    """A deployment handle whose calls never answer (replicas dead or stuck)."""

    deployment_name = "EngineReplica"

    def __init__(self) -> None:
        self.calls: list[HungCall] = []

    def options(self, **_: object) -> HungHandle:
        return self

    def remote(self, _payload: object) -> HungCall:
        self.calls.append(HungCall())
        return self.calls[-1]


def test_no_call_waits_on_a_dead_replica_beyond_its_bound() -> None:
    """A control call for a replica the router no longer lists fails as ``ReplicaGone``
    (without waiting out its 60 s timeout); one for a listed replica that does not answer
    times out; a request no replica starts ends with an error result after
    ``accept_seconds`` (not retried); every hung call is cancelled."""
    from mmserve.fleet import registry
    from mmserve.fleet.client import ReplicaClient, ReplicaGone
    from mmserve.types import EngineRequest

    class Listing:
        def replica_ids(self) -> list[str]:
            return ["alive"]

    registry.register("dead-unit", "EngineReplica", Listing())
    handle = HungHandle()
    client = ReplicaClient(handle, "dead-unit", tokenizer=None, accept_seconds=0.5)

    async def main() -> list:
        with pytest.raises(ReplicaGone, match="dead"):
            await client.call("health", "dead", timeout=60)
        with pytest.raises(TimeoutError):
            await client.call("health", "alive", timeout=0.5)
        req = EngineRequest((1, 2, 3), (), SamplingParams(max_tokens=2))
        return [u async for u in client.stream(req)]

    updates = asyncio.run(asyncio.wait_for(main(), 30))
    assert len(handle.calls) == 3 and all(c.cancelled for c in handle.calls)
    (last,) = updates
    assert last.result.finish_reason == "error"
    assert last.result.error == "no replica started the request within 0.5 s"
    assert client.retries == 0 and client.replica_failures == 0


def test_cache_router_counts_the_shared_disk_tier() -> None:
    """With a disk tier shared by the replicas, a prompt whose prefix no replica's tree
    holds any more (trimmed) but some replica computed goes to the least-loaded replica
    as a ``disk`` hit, its tokens counted as matched; without the tier, ``no_match``."""
    from ray.serve._private.common import (
        DeploymentHandleSource,
        DeploymentID,
        RequestMetadata,
    )
    from ray.serve.request_router import PendingRequest

    from mmserve.fleet.protocol import ReplicaRequest
    from mmserve.fleet.router import CacheAwareRouter

    def images(n: int, size: int = 60) -> list[list[int]]:
        return [[-(1000 * k + i + 1) for i in range(size)] for k in range(n)]

    async def run(disk_tokens: int) -> tuple[dict, str]:
        dep = DeploymentID(name="EngineReplica", app_name=f"disk{disk_tokens}")
        router = CacheAwareRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(max_tree_tokens=150, disk_tree_tokens=disk_tokens)
        a, b = FakeReplica("a", dep), FakeReplica("b", dep)
        router.update_replicas([a, b])
        last = ""
        for k, ids in enumerate([*images(6), images(1)[0]]):  # the first image comes back
            pr = PendingRequest(
                args=[ReplicaRequest(f"r{k}", [*ids, 7], [], SamplingParams())],
                kwargs={},
                metadata=RequestMetadata(request_id=f"r{k}", internal_request_id=f"r{k}"),
            )
            chosen = (await router.choose_replicas([a, b], pr))[0][0]
            router.on_request_routed(pr, chosen.replica_id, None)
            router.on_request_completed(chosen.replica_id, f"r{k}")
            last = chosen.replica_id.unique_id
        return router.snapshot(), last

    snap, _ = asyncio.run(run(0))
    assert snap["by_reason"] == {"no_match": 7} and snap["disk_tree_tokens"] == 0
    snap, last = asyncio.run(run(10_000))
    # each replica's tree (150 tokens) trimmed the first image; the disk tree kept it
    assert snap["by_reason"] == {"no_match": 6, "disk": 1}
    assert snap["replicas"][last]["matched_tokens"] == 61  # the repeated prompt, whole
    assert snap["disk_tree_tokens"] == 6 * 61  # six distinct prompts


# ---- two replicas, cache router --------------------------------------------------------


@pytest.fixture(scope="class")
def cache_ep(model_dir: Path):
    """``mmserve serve --replicas 2`` with the cache router (for one test class)."""
    with live_server(model_dir, *RAY_ARGS, timeout=START_TIMEOUT) as url:
        yield both_replicas_up(url)


@pytest.fixture(scope="class")
def rr_ep(model_dir: Path):
    """Two replicas with ``--replica-router round_robin`` and a queue limit of 4."""
    args = (*RAY_ARGS, "--replica-router", "round_robin", "--max-queued-requests", "4")
    with live_server(model_dir, *args, timeout=START_TIMEOUT) as url:
        yield both_replicas_up(url)


def both_replicas_up(url: str) -> str:
    """``url`` once both replicas are healthy: ``/health`` is 200 as soon as one is."""

    def up() -> bool:
        return httpx.get(f"{url}/health", timeout=10).json().get("healthy_replicas") == 2

    wait_for(up, START_TIMEOUT, "both replicas healthy")
    return url


class TestCacheRouter:
    """Two tiny replicas behind ``mmserve serve --replicas 2`` (cache router)."""

    @pytest.fixture
    def ep(self, cache_ep: str) -> str:
        return cache_ep

    def test_answers_equal_the_single_process_server(self, ep: str, single: str) -> None:
        red, green = png((220, 30, 30)), png((30, 200, 60), (48, 64))
        ids = {u: upload(u, green) for u in (ep, single)}
        assert ids[ep] == ids[single]  # content-addressed: the same id everywhere
        gid = ids[ep]
        history = [
            {"role": "system", "content": "You are terse."},
            user(image(data_url(red)), "What colour is this?"),
            {"role": "assistant", "content": "Red."},
            user(image(gid), "And this one?"),
        ]
        cases = [
            ([user("Say hello.")], {}),
            ([user(image(data_url(red)), "Describe it.")], {}),
            ([user(image(gid), "Describe it.")], {"max_tokens": 9}),
            (history, {}),
            ([user(image(gid), "Describe it.")], {"n": 2}),
            ([user("Count to three.")], {"logprobs": True, "top_logprobs": 2}),
        ]
        for messages, kw in cases:
            a, b = chat(ep, messages, **kw), chat(single, messages, **kw)
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            ja, jb = a.json(), b.json()
            assert [c["message"]["content"] for c in ja["choices"]] == [
                c["message"]["content"] for c in jb["choices"]
            ], kw
            assert ja["usage"]["prompt_tokens"] == jb["usage"]["prompt_tokens"]
            assert ja["usage"]["completion_tokens"] == jb["usage"]["completion_tokens"]
            if kw.get("logprobs"):
                la = ja["choices"][0]["logprobs"]["content"]
                lb = jb["choices"][0]["logprobs"]["content"]
                assert [t["token"] for t in la] == [t["token"] for t in lb]
                assert [len(t["top_logprobs"]) for t in la] == [2] * len(la)
                for x, y in zip(la, lb, strict=True):
                    assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)
            # streamed: the same text, chunk by chunk
            if "n" not in kw and not kw.get("logprobs"):
                text, events = streamed(ep, messages, **kw)
                assert text == jb["choices"][0]["message"]["content"]
                assert events[-1]["choices"][0]["finish_reason"] == "length"
        # several questions in one call
        body = {"model": MODEL, "questions": ["What is it?", "Where?"], "max_tokens": 5}
        a = httpx.post(f"{ep}/v1/images/{gid}/ask", json={**body, "temperature": 0}, timeout=60)
        b = httpx.post(f"{single}/v1/images/{gid}/ask", json={**body, "temperature": 0})
        assert a.status_code == b.status_code == 200
        assert [x["answer"] for x in a.json()["answers"]] == [
            x["answer"] for x in b.json()["answers"]
        ]
        # the same errors and limits
        for messages, kw in [
            ([user(image("img-" + "0" * 32), "?")], {}),
            ([user("Hi")], {"max_tokens": 100_000}),
            ([user(*[image(data_url(red))] * 9, "?")], {}),
            ([user(image("data:image/png;base64,AAAA"), "?")], {}),
        ]:
            a, b = chat(ep, messages, **kw), chat(single, messages, **kw)
            assert a.status_code == b.status_code == 400
            assert a.json() == b.json()
        assert httpx.get(f"{ep}/v1/models").json() == httpx.get(f"{single}/v1/models").json()
        # the Responses API runs through the replicas too
        rbody = {
            "model": MODEL,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": gid},
                        {"type": "input_text", "text": "Describe it."},
                    ],
                }
            ],
            "max_output_tokens": 6,
            "temperature": 0,
        }
        a = httpx.post(f"{ep}/v1/responses", json=rbody, timeout=60)
        b = httpx.post(f"{single}/v1/responses", json=rbody, timeout=60)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        ta = [p["text"] for o in a.json()["output"] for p in o["content"]]
        assert ta == [p["text"] for o in b.json()["output"] for p in o["content"]]
        assert a.json()["usage"]["input_tokens"] == b.json()["usage"]["input_tokens"]

    def test_interleaved_workload_hit_rate_and_tower_runs(
        self, ep: str, single_workload: dict
    ) -> None:
        res = run_workload(ep)
        one = single_workload
        assert res["hit_rate"] >= 0.95 * one["hit_rate"], (res["hit_rate"], one["hit_rate"])
        assert res["tower_runs_per_image"] <= 1.1, res["vision_tower_runs"]
        # pixels went to a replica only when its tower ran
        assert res["pixel_fetches"] <= res["vision_tower_runs"]
        # both replicas served; every answer equals one engine's (greedy)
        assert all(v["requests"] for v in res["per_replica"].values()), res["per_replica"]
        assert [r["text"] for r in res["replies"]] == [r["text"] for r in one["replies"]]
        assert res["router"].get("prefix", 0) > 0 and res["router"].get("no_match", 0) > 0

    def test_stats_metrics_health_and_flush_cover_every_replica(self, ep: str) -> None:
        health = httpx.get(f"{ep}/health").json()
        assert health["status"] == "ok" and health["healthy_replicas"] == 2
        s = stats(ep)
        per = s["replicas"]
        assert s["num_replicas"] == 2 and len(per) == 2
        assert len({r["pid"] for r in per.values()}) == 2
        for key in ("prompt_tokens", "cached_tokens", "vision_tower_images", "pool_pages"):
            assert s[key] == sum(r[key] for r in per.values()), key
        assert s["cache_hit_rate"] == pytest.approx(s["cached_tokens"] / s["prompt_tokens"])
        assert s["accounting"]["ok"] and s["accounting"]["total"] == s["pool_pages"]
        assert set(s["router"]["replicas"]) == set(per) and s["router"]["policy"] == "cache"
        text = httpx.get(f"{ep}/metrics").text
        by = {m: metric(text, "mmserve_prompt_tokens_total", {"modality": m}) for m in MODALITIES}
        assert sum(by.values()) == s["prompt_tokens"]
        assert by["image"] == s["prompt_image_tokens"]
        for uid, r in per.items():
            labels = {"replica": uid}
            assert metric(text, "mmserve_replica_up", labels) == 1
            assert metric(text, "mmserve_replica_cache_hit_rate", labels) == pytest.approx(
                r["cache_hit_rate"]
            )
            assert metric(text, "mmserve_replica_prompt_tokens_total", labels) == r["prompt_tokens"]
        routed = sum(
            metric(text, "mmserve_router_requests_total", {"replica": u, "reason": why}, 0.0)
            for u in per
            for why in ("prefix", "no_match", "load")
        )
        assert routed == sum(sum(r["routed"].values()) for r in s["router"]["replicas"].values())
        # flush empties every replica and the router's trees
        flush(ep)
        s = stats(ep)
        assert s["tree_pages"] == 0 and all(r["tree_pages"] == 0 for r in s["replicas"].values())
        assert all(r["tree_tokens"] == 0 for r in s["router"]["replicas"].values())
        # refused while a request runs; a client that goes away aborts its request
        body = {
            "model": MODEL,
            "messages": [user("Talk.")],
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{ep}/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            while not next(lines).startswith('data: {"id"'):
                pass
            busy = httpx.post(f"{ep}/v1/cache/flush", timeout=60)
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "requests_running"
        wait_for(lambda: stats(ep)["live_requests"] == 0, 30, "the abandoned request to end")
        s = stats(ep)
        assert s["completion_tokens"] < 3000 and s["requests_by_finish_reason"].get("abort")
        flush(ep)

    def test_a_killed_replica_costs_no_hung_request_and_comes_back(self, ep: str) -> None:
        before = stats(ep)
        pids = {uid: r["pid"] for uid, r in before["replicas"].items()}

        async def one(http: httpx.AsyncClient, i: int, stream: bool) -> tuple[str, int, str]:
            body = {
                "model": MODEL,
                "messages": [user(f"Request {i}: count slowly.")],
                "max_tokens": 400,
                "ignore_eos": True,
                "temperature": 0,
                "stream": stream,
            }
            if not stream:
                r = await http.post(f"{ep}/v1/chat/completions", json=body)
                return "plain", r.status_code, r.text
            async with http.stream("POST", f"{ep}/v1/chat/completions", json=body) as r:
                lines = [x async for x in r.aiter_lines() if x.startswith("data: ")]
            return "stream", r.status_code, "\n".join(lines[-3:])

        async def run() -> tuple[str, list]:
            async with httpx.AsyncClient(timeout=120) as http:
                tasks = [asyncio.ensure_future(one(http, i, i % 2 == 1)) for i in range(6)]

                def busiest() -> str | None:
                    live = {u: r.get("live_requests", 0) for u, r in stats(ep)["replicas"].items()}
                    top = max(live, key=live.get)
                    return top if live[top] >= 2 else None

                victim = await asyncio.to_thread(wait_for, busiest, 60, "requests to run")
                await asyncio.sleep(0.5)
                os.kill(pids[victim], signal.SIGKILL)
                done = await asyncio.wait_for(asyncio.gather(*tasks), 150)
            return victim, done

        victim, done = asyncio.run(run())
        for kind, status, text in done:
            if kind == "plain":  # retried once on the other replica, else a 500
                assert status in (200, 500), text
                if status == 500:
                    assert "died" in text
                else:
                    assert json.loads(text)["usage"]["completion_tokens"] == 400
            else:  # an error event, or the whole answer; always [DONE]
                assert status == 200 and text.endswith("data: [DONE]"), text
                assert ('"error"' in text and "died" in text) or '"length"' in text, text
        after = stats(ep)
        assert after["replica_failures"] > before["replica_failures"]
        assert after["retries"] > before["retries"]
        assert sum(k == "plain" and s == 200 for k, s, _ in done) >= 1

        def restarted() -> dict | None:
            h = httpx.get(f"{ep}/health", timeout=30).json()
            fresh = set(h.get("replicas", {})) - set(pids)
            return h if h.get("healthy_replicas") == 2 and fresh else None

        health = wait_for(restarted, 180, "Ray to restart the replica", every=1.0)
        assert victim not in health["replicas"]
        (new,) = set(health["replicas"]) - set(pids)
        # the endpoint serves again and the router sends new work to the new replica
        for i in range(4):
            r = chat(ep, [user(image(data_url(png((i * 60, 90, 200)))), "What is it?")])
            assert r.status_code == 200, r.text
        routed = stats(ep)["router"]["replicas"][new]["routed"]
        assert sum(routed.values()) >= 1, routed

    def test_replicas_killed_idle_and_between_requests_leave_the_endpoint_serving(
        self, ep: str
    ) -> None:
        """Two deaths in a row (issue 31): an idle replica, then the one that just answered
        a question, killed before the same question comes again (the cache router prefers
        the dead replica's tree). Each time the next requests are answered (within the
        client's bounded timeout), ``/health`` is 200 "degraded", and once Ray's
        replacement joins it is "ok" and the router sends it work."""

        def health() -> dict:
            r = httpx.get(f"{ep}/health", timeout=30)
            assert r.status_code == 200, r.text
            return r.json()

        def replaced(dead: set[str]) -> dict | None:
            h = health()
            return h if h["status"] == "ok" and not dead & set(h["replicas"]) else None

        def answered(messages: list[dict]) -> dict:
            """The answer, which must come within 30 s (no waiting on a dead replica)."""
            body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
            r = httpx.post(f"{ep}/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()

        def served(uid: str, before: dict) -> int:
            return (
                stats(ep)["replicas"][uid]["requests_finished"] - before[uid]["requests_finished"]
            )

        question = [user(image(data_url(png((10, 120, 90)))), "What is it?")]
        wait_for(lambda: replaced(set()), 180, "both replicas healthy", every=1.0)
        for n, death in enumerate(("idle", "between requests")):
            before = stats(ep)["replicas"]
            pids = {uid: r["pid"] for uid, r in before.items()}
            if death == "idle":
                for i in range(3):
                    answered([user(f"Warm up {i}.")])
                time.sleep(2.0)
                victim = sorted(pids)[0]
            else:
                first = answered(question)
                (victim,) = [u for u in pids if served(u, before) == 1]
            os.kill(pids[victim], signal.SIGKILL)
            h = health()  # at once: the dead replica is not waited on
            assert h["status"] == "degraded" and h["healthy_replicas"] == 1, h
            assert not isinstance(h["replicas"].get(victim), dict), h
            again = answered(question)
            if death != "idle":  # the same answer from the survivor
                assert again["choices"] == first["choices"]
            for i in range(3):
                answered([user(f"After {i}.")])
            h = wait_for(lambda v=victim: replaced({v}), 180, "the replacement to join", every=1.0)
            (new,) = set(h["replicas"]) - set(pids)
            assert stats(ep)["router"]["replicas"][new]["alive"]
            for i in range(4):  # images no replica has seen go to the one with the smaller tree
                color = (i * 60 + 7, 33 + 100 * n, 150)
                answered([user(image(data_url(png(color))), "What is it?")])
            assert sum(stats(ep)["router"]["replicas"][new]["routed"].values()) >= 1


# ---- two replicas, round-robin ---------------------------------------------------------


class TestRoundRobin:
    """Two tiny replicas with ``--replica-router round_robin`` and a small queue."""

    @pytest.fixture
    def ep(self, rr_ep: str) -> str:
        return rr_ep

    def test_uploads_resolve_on_both_replicas(self, ep: str) -> None:
        flush(ep)
        before = stats(ep)["replicas"]  # other tests of the class may have run first
        iid = upload(ep, png((120, 40, 160), (50, 50)))
        vid = upload(ep, encode_mp4(rgb_frames(4, seed=3)), "videos")
        texts = set()
        for _ in range(2):  # round-robin: one question on each replica
            r = chat(ep, [user(image(iid), "What is it?")])
            assert r.status_code == 200, r.text
            texts.add(r.json()["choices"][0]["message"]["content"])
        assert len(texts) == 1  # the same answer from both
        per = stats(ep)["replicas"]
        for uid, r in per.items():  # each replica fetched the new image's pixels and ran it once
            for key in ("pixel_fetches", "vision_tower_images"):
                assert r[key] - before[uid][key] == 1, (uid, key, r[key], before[uid][key])
        # a stored video's frames, asked about on both replicas
        r = httpx.post(
            f"{ep}/v1/videos/{vid}/qa",
            json={"questions": ["What moves?"], "num_frames": 2, "max_tokens": 3},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        events = [json.loads(x) for x in r.text.splitlines()]
        assert events[-1]["type"] == "summary" and events[-1]["answers"] == 2
        finished = sum(r["requests_finished"] for r in stats(ep)["replicas"].values())
        assert finished - sum(r["requests_finished"] for r in before.values()) == 4

    def test_round_robin_hit_rate_is_lower(self, ep: str, single_workload: dict) -> None:
        res = run_workload(ep)
        one = single_workload
        assert res["hit_rate"] < 0.9 * one["hit_rate"], (res["hit_rate"], one["hit_rate"])
        # (the cache router's is >= 0.95 x one engine's: TestCacheRouter, same workload)
        assert res["tower_runs_per_image"] > 1.2
        assert [r["text"] for r in res["replies"]] == [r["text"] for r in one["replies"]]

    def test_a_burst_beyond_the_queue_limit_gets_503_with_retry_after(self, ep: str) -> None:
        name = "mmserve_requests_rejected_total"
        rejected = metric(httpx.get(f"{ep}/metrics").text, name, default=0.0)

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as http:
                body = {"model": MODEL, "max_tokens": 24, "ignore_eos": True}
                return await asyncio.gather(
                    *(
                        http.post(
                            f"{ep}/v1/chat/completions",
                            json={**body, "messages": [user(f"Burst {i}.")]},
                        )
                        for i in range(24)
                    )
                )

        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 503} and codes.count(200) >= 4 and 503 in codes, codes
        for r in responses:
            if r.status_code == 503:
                assert r.headers["Retry-After"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
        text = httpx.get(f"{ep}/metrics").text
        assert metric(text, name) - rejected == codes.count(503)


# ---- bf16 under --deterministic -----------------------------------------------------------

#: The served dtype where answers could differ by rounding, and the mode that removes it.
DETERMINISTIC_ARGS = ("--dtype", "bfloat16", "--deterministic")


@pytest.fixture(scope="class")
def deterministic_pair(model_dir: Path):
    """``(one process, two round-robin replicas)``, both bf16 under ``--deterministic``."""
    with (
        live_server(model_dir, "--served-model-name", MODEL, *DETERMINISTIC_ARGS) as one,
        live_server(
            model_dir, *RAY_ARGS, "--replica-router", "round_robin", *DETERMINISTIC_ARGS,
            timeout=START_TIMEOUT,
        ) as url,
    ):  # fmt: skip
        yield one, both_replicas_up(url)


def _bits(resp: httpx.Response) -> list:
    """Every choice's text, tokens, logprobs and top logprobs, exactly as served."""
    assert resp.status_code == 200, resp.text
    return [
        (
            c["message"]["content"],
            [
                (t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top_logprobs"]])
                for t in c["logprobs"]["content"]
            ],
        )
        for c in resp.json()["choices"]
    ]


class TestDeterministicBf16:
    """Replicas answer one process's bits: each replica is its own process with its own
    cache history and batches, and the mode makes none of that change a bit."""

    def test_replicas_equal_one_process_bit_for_bit(self, deterministic_pair) -> None:
        one, ep = deterministic_pair
        red, green = data_url(png((220, 30, 30))), data_url(png((30, 200, 60), (48, 64)))
        cases = [
            [user("Say hello.")],
            [user(image(red), "Describe it.")],
            [user(image(red), "What colour is this?")],  # the picture cached on some replica
            [user(image(green), "Describe it.")],
            [user(image(green), "Describe it."), {"role": "assistant", "content": "Green."},
             user(image(red), "And this one?")],
        ]  # fmt: skip
        kw = {"logprobs": True, "top_logprobs": 2, "max_tokens": 6}
        alone = [_bits(chat(one, m, **kw)) for m in cases]  # one at a time, in order

        async def fleet() -> list[list]:
            # every case twice at once: round robin puts them on both replicas, cold and
            # warm, in shared batches
            async with httpx.AsyncClient(timeout=120) as http:
                body = {"model": MODEL, "temperature": 0, **kw}
                sent = [
                    http.post(f"{ep}/v1/chat/completions", json={**body, "messages": m})
                    for m in cases + cases
                ]
                return [_bits(r) for r in await asyncio.gather(*sent)]

        got = asyncio.run(fleet())
        assert got == alone + alone
        n2 = _bits(chat(ep, cases[1], n=2, **kw))
        assert n2 == alone[1] * 2  # both choices, the alone answer
        served = stats(ep)["replicas"]
        assert all(r["prompt_tokens"] > 0 for r in served.values()), served  # both answered


# ---- encoders --------------------------------------------------------------------------


def test_feature_store_keeps_its_byte_bound_least_recently_used_first() -> None:
    from mmserve.fleet.encoder import FeatureRef, FeatureStore

    store = FeatureStore(max_bytes=300)
    for k in range(3):
        store.put(FeatureRef(bytes([k]), f"ref{k}", 100, True))
    assert len(store) == 3 and store.nbytes == 300 and store.released == 0
    assert store.get(bytes([0])).ref == "ref0"  # now the most recently used
    store.put(FeatureRef(b"\x09", "ref9", 150, True))  # 450 > 300: 1 and 2 go, 0 stays
    assert store.nbytes == 250 and store.released == 2
    assert store.get(bytes([1])) is None and store.get(bytes([2])) is None
    assert store.get(bytes([0])).ref == "ref0" and store.get(b"\x09").ref == "ref9"
    with pytest.raises(ValueError, match="encoder cache bytes"):
        FeatureStore(0)


def test_encoder_router_sends_each_key_to_one_encoder_and_moves_only_a_dead_ones_keys() -> None:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from mmserve.fleet.encoder import EncodeCall, KeyAffinityRouter
    from mmserve.fleet.protocol import ControlCall
    from mmserve.fleet.registry import find_router

    dep = DeploymentID(name="VisionEncoder", app_name="enc-unit")

    def pending(arg: object, rid: str) -> PendingRequest:
        md = RequestMetadata(request_id=rid, internal_request_id=rid)
        return PendingRequest(args=[arg], kwargs={}, metadata=md)

    async def main() -> None:
        router = KeyAffinityRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        assert find_router("enc-unit", "VisionEncoder") is router
        encs = [FakeReplica(u, dep) for u in ("e1", "e2", "e3")]

        async def home(key: bytes, cands: list) -> str:
            pr = pending(EncodeCall(key, "image", None), key.hex())
            ranked = await router.choose_replicas(cands, pr)
            assert pr.routing_context.should_backoff
            assert sorted(r[0].replica_id.unique_id for r in ranked) == sorted(
                c.replica_id.unique_id for c in cands
            )
            return ranked[0][0].replica_id.unique_id

        keys = [bytes([k]) * 16 for k in range(40)]
        homes = {k: await home(k, encs) for k in keys}
        assert len(set(homes.values())) == 3  # keys spread over the encoders
        assert homes == {k: await home(k, encs[::-1]) for k in keys}  # order does not matter
        alive = [e for e in encs if e.replica_id.unique_id != "e2"]
        moved = {k: await home(k, alive) for k in keys}
        assert all(moved[k] == homes[k] for k in keys if homes[k] != "e2")
        assert all(moved[k] != "e2" for k in keys)
        gone = pending(ControlCall("stats", target="e2"), "c")
        assert await router.choose_replicas(alive, gone) == []
        assert gone.routing_context.should_backoff

    asyncio.run(main())


# ---- the model identity in the fleet's shared caches ---------------------------------------
MODEL_A, MODEL_B = b"A" * 16, b"B" * 16


def test_encoder_features_are_keyed_on_the_model_and_another_model_is_refused() -> None:
    """An encoder of one checkpoint never answers a replica of another (a redeployment
    runs both at once): its store keys features on the model too, it refuses a call for
    another model, and a replica drops features that name another model (its own tower
    runs)."""
    from mmserve.fleet.encoder import (
        EncodeCall,
        EncoderClient,
        FeatureRef,
        FeatureStore,
        VisionEncoder,
    )

    key = b"k" * 16
    store = FeatureStore(max_bytes=1000)
    store.put(FeatureRef(key, "feats of A", 10, True, MODEL_A))
    assert store.get(key, MODEL_A).ref == "feats of A"
    assert store.get(key, MODEL_B) is None and store.get(key) is None

    enc = VisionEncoder.__new__(VisionEncoder)  # its state only (no Ray replica context)
    enc.identity, enc.store, enc._inflight = MODEL_A, store, {}
    enc.fetches = enc.hits = enc.queue = 0
    got = asyncio.run(enc.encode(EncodeCall(key, "image", None, MODEL_A)))
    assert (got.ref, got.model, got.encoded, enc.hits) == ("feats of A", MODEL_A, False, 1)
    with pytest.raises(ValueError, match="serves model 4141"):
        asyncio.run(enc.encode(EncodeCall(key, "image", None, MODEL_B)))
    with pytest.raises(ValueError, match="no model"):
        asyncio.run(enc.encode(EncodeCall(key, "image", None)))

    class Answer:
        def __init__(self, feature: FeatureRef) -> None:
            self.feature = feature

        def result(self, timeout_s: float) -> FeatureRef:
            return self.feature

        def cancel(self) -> None:
            pass

    class Handle:
        """An encoder deployment whose encoder answers with model A's features."""

        calls: list[EncodeCall] = []

        class encode:
            @staticmethod
            def remote(call: EncodeCall) -> Answer:
                Handle.calls.append(call)
                return Answer(FeatureRef(call.key, "ref", 10, True, MODEL_A))

    item = dataclasses.make_dataclass("Item", ["key", "mode", "pixels_ref"])(key, "image", "px")
    client = EncoderClient(Handle, timeout=1.0, model=MODEL_B)
    assert client([item]) == [None] and client.fallbacks == 1 and client.fetched == 0
    assert Handle.calls[-1].model == MODEL_B


def test_cache_router_keys_prefixes_on_the_model() -> None:
    """A prompt routed (and recorded) for one checkpoint is no prefix hit, and no disk
    hit, for another: the trees keep each model's sequences apart."""
    from ray.serve._private.common import (
        DeploymentHandleSource,
        DeploymentID,
        RequestMetadata,
    )
    from ray.serve.request_router import PendingRequest

    from mmserve.fleet.protocol import ReplicaRequest
    from mmserve.fleet.router import CacheAwareRouter

    dep = DeploymentID(name="EngineReplica", app_name="models")
    a, b = FakeReplica("a", dep), FakeReplica("b", dep)
    prompt = [*range(10), *(-(i + 1) for i in range(50)), 7]

    async def route(router: CacheAwareRouter, model: bytes, rid: str) -> str:
        rr = ReplicaRequest(rid, prompt, [], SamplingParams(), model=model)
        md = RequestMetadata(request_id=rid, internal_request_id=rid)
        pr = PendingRequest(args=[rr], kwargs={}, metadata=md)
        chosen = (await router.choose_replicas([a, b], pr))[0][0]
        router.on_request_routed(pr, chosen.replica_id, None)
        router.on_request_completed(chosen.replica_id, rid)
        return chosen.replica_id.unique_id

    async def main() -> None:
        router = CacheAwareRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(max_tree_tokens=1000, disk_tree_tokens=10_000)
        router.update_replicas([a, b])
        first = await route(router, MODEL_A, "a1")
        assert await route(router, MODEL_A, "a2") == first
        await route(router, MODEL_B, "b1")
        snap = router.snapshot()
        assert snap["by_reason"] == {"no_match": 2, "prefix": 1}, snap["by_reason"]
        held = {u: r["matched_tokens"] for u, r in snap["replicas"].items()}
        assert sum(held.values()) == len(prompt)  # only A's second request matched
        assert snap["disk_tree_tokens"] == 2 * len(prompt)  # the same ids, two models
        router.record_output("b", [*prompt, 1, 2], MODEL_A)
        assert router.snapshot()["replicas"]["b"]["tree_tokens"] == 2 * len(prompt) + 2

    asyncio.run(main())


@pytest.fixture(scope="class")
def enc_ep(model_dir: Path, loaded, tmp_path_factory: pytest.TempPathFactory):
    """Two replicas (pow2) sharing one encoder whose store holds three images' features;
    batch files under a data directory of their own."""
    (feats,) = loaded.vision.encode([Image.open(io.BytesIO(png((1, 2, 3))))])
    per_image = feats.numel() * feats.element_size()
    args = (
        *RAY_ARGS,
        "--replica-router",
        "pow2",
        "--encoders",
        "1",
        "--cpus-per-encoder",
        "0.5",
        "--encoder-cache-bytes",
        str(3 * per_image),
        "--data-dir",
        str(tmp_path_factory.mktemp("replica-batches")),
    )
    with live_server(model_dir, *args, timeout=START_TIMEOUT) as url:
        yield both_replicas_up(url), per_image


class TestEncoders:
    """``--encoders 1``: the tower runs once per image for the whole deployment."""

    def test_features_from_the_encoder_give_one_process_answers_once_per_image(
        self, enc_ep: tuple[str, int], single: str
    ) -> None:
        ep, per_image = enc_ep
        colors = [(200, 10, 10), (10, 200, 10), (10, 10, 200), (200, 200, 10)]
        for c in colors:  # two questions per image: pow2 sends them to either replica
            for q in ("What is it?", "Describe it."):
                messages = [user(image(data_url(png(c))), q)]
                a, b = chat(ep, messages), chat(single, messages)
                assert a.status_code == b.status_code == 200, (a.text, b.text)
                assert a.json()["choices"] == b.json()["choices"]
        s = stats(ep)
        ((uid, enc),) = s["encoders"].items()
        assert enc["runs"] == len(colors) and s["tower_runs"] == len(colors)
        assert s["vision_tower_images"] == 0  # no replica ran its own tower
        got = sum(r["encoder_feature_images"] for r in s["replicas"].values())
        assert got == enc["fetches"] >= len(colors)
        # the store's bound: three images' features, the oldest released
        assert enc["bytes"] == 3 * per_image <= enc["capacity_bytes"]
        assert enc["entries"] == 3 and enc["released"] == 1
        text = httpx.get(f"{ep}/metrics").text
        assert metric(text, "mmserve_encoder_runs_total", {"encoder": uid}) == len(colors)
        assert metric(text, "mmserve_encoder_features_bytes", {"encoder": uid}) == enc["bytes"]
        # a dead encoder loses no request: Ray's replacement or the replica's own tower
        os.kill(enc["pid"], signal.SIGKILL)
        messages = [user(image(data_url(png((90, 60, 30)))), "What is it?")]
        a, b = chat(ep, messages), chat(single, messages)
        assert a.status_code == 200, a.text
        assert a.json()["choices"] == b.json()["choices"]
        after = stats(ep)
        fallbacks = sum(r["encoder_fallbacks"] for r in after["replicas"].values())
        if after["vision_tower_images"]:  # no encoder answered in time: the replica's tower
            assert after["vision_tower_images"] == 1 and fallbacks >= 1
        else:  # Ray's replacement encoder answered
            assert fallbacks == 0 and not isinstance(after["encoders"].get(uid), dict)
            assert sum(e["runs"] for e in after["encoders"].values() if isinstance(e, dict)) == 1

    def test_cache_salts_share_no_features_or_prefix_across_the_fleet(
        self, enc_ep: tuple[str, int]
    ) -> None:
        """``cache_salt`` under ``--replicas`` with ``--encoders`` (issue 42): another
        salt's request about the same image gets no cached tokens and its own tower run
        on the encoder; the same salt shares as before."""
        ep, _ = enc_ep
        messages = [user(image(data_url(png((33, 66, 99)))), "What is it?")]

        def ask(salt: str) -> tuple[int, int]:
            before = stats(ep)["tower_runs"]
            r = chat(ep, messages, cache_salt=salt)
            assert r.status_code == 200, r.text
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            return cached, stats(ep)["tower_runs"] - before

        assert ask("alice") == (0, 1)
        assert ask("bob") == (0, 1)  # bob's features are his own: encoded again
        cached, runs = ask("alice")
        assert runs == 0  # alice's features: the encoder's store or a replica's cache
        # pow2 may send it to the other replica, whose cache is cold (then 0 cached)
        assert cached == 0 or cached >= 576

    def test_files_and_batches_run_through_the_router_and_survive_a_replica_death(
        self, enc_ep: tuple[str, int]
    ) -> None:
        """``/v1/files`` + ``/v1/batches`` with the openai client under replicas: a
        replica killed while lines run on it costs no line (sent once more), and the
        answers equal the endpoint's online ones."""
        ep, _ = enc_ep
        client = openai_client(ep)
        bodies = {
            f"img{k}-{q}": {
                "model": MODEL,
                "messages": [user(image(data_url(png((k * 70, 140, 20)))), q)],
                "max_tokens": 4,
                "temperature": 0,
            }
            for k in range(2)
            for q in ("What is it?", "Where is it?")
        }
        for i in range(8):
            bodies[f"long{i}"] = {
                "model": MODEL,
                "messages": [user(f"Line {i}: count slowly.")],
                "max_tokens": 200,
                "ignore_eos": True,
                "temperature": 0,
            }
        before = stats(ep)
        pids = {uid: r["pid"] for uid, r in before["replicas"].items()}
        batch = start_batch(client, bodies)

        def busy() -> str | None:
            live = {u: r.get("live_requests", 0) for u, r in stats(ep)["replicas"].items()}
            live = {u: n for u, n in live.items() if u in pids and n}
            return max(live, key=live.get) if live else None

        victim = wait_for(busy, 120, "batch lines to run on a replica", every=0.2)
        os.kill(pids[victim], signal.SIGKILL)

        batch = completed_batch(client, batch.id, len(bodies))
        assert stats(ep)["retries"] > before["retries"]
        out = [json.loads(t) for t in client.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(r["custom_id"] for r in out) == sorted(bodies)
        for r in out:
            body = r["response"]["body"]
            if r["custom_id"].startswith("long"):
                assert body["usage"]["completion_tokens"] == 200
            else:
                online = chat(ep, bodies[r["custom_id"]]["messages"], max_tokens=4)
                assert body["choices"][0]["message"] == online.json()["choices"][0]["message"]

    def test_a_restarted_replica_gets_known_images_features_from_the_encoder(
        self, enc_ep: tuple[str, int]
    ) -> None:
        """A replica killed and replaced by Ray: its first requests about images the
        deployment has seen run no tower anywhere, their features come from the encoder's
        store (issue 35's "replica killed mid-run and restarted" measurement)."""
        ep, _ = enc_ep

        def healthy() -> dict | None:
            h = httpx.get(f"{ep}/health", timeout=30).json()
            s = stats(ep)
            ok = h.get("status") == "ok" and s["encoders"]
            return s if ok and all(isinstance(e, dict) for e in s["encoders"].values()) else None

        wait_for(healthy, 180, "both replicas and the encoder up", every=1.0)
        known = [png((30, 170, k * 90)) for k in range(2)]
        for data in known:  # encoded once, by the encoder
            assert chat(ep, [user(image(data_url(data)), "What is it?")]).status_code == 200
        before = stats(ep)
        pids = {uid: r["pid"] for uid, r in before["replicas"].items()}
        victim = sorted(pids)[0]
        os.kill(pids[victim], signal.SIGKILL)

        def replaced() -> dict | None:
            s = healthy()
            return s if s and victim not in s["replicas"] else None

        s = wait_for(replaced, 180, "Ray to replace the replica", every=1.0)
        (new,) = set(s["replicas"]) - set(pids)
        (survivor,) = set(pids) - {victim}
        runs = sum(e["runs"] for e in s["encoders"].values())
        served = 0
        for i in range(16):  # pow2 picks either replica: ask until the new one served two
            messages = [user(image(data_url(known[i % 2])), f"Question {i}: what is it?")]
            assert chat(ep, messages).status_code == 200
            served = stats(ep)["replicas"][new]["requests_finished"]
            if served >= 2:
                break
        after = stats(ep)
        fresh, old = after["replicas"][new], after["replicas"][survivor]
        assert fresh["requests_finished"] >= 1, "pow2 sent no request to the new replica"
        assert fresh["vision_tower_images"] == 0 and fresh["encoder_feature_images"] >= 1
        assert fresh["encoder_fallbacks"] == 0
        assert old["vision_tower_images"] == before["replicas"][survivor]["vision_tower_images"]
        assert sum(e["runs"] for e in after["encoders"].values()) == runs  # no tower ran


def test_a_feature_source_stands_in_for_the_tower(make_engine) -> None:
    """Features handed to the engine by a feature source (what a replica gets from the
    encoder deployment) give the tokens of the engine's own tower, with no tower run
    here; an item the source does not have (None) runs the tower as before."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q?"}]}]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    red, blue = png((200, 10, 10)), png((10, 10, 200))

    def run(eng, data: bytes):
        p = eng.processor
        return eng.generate(
            [p.make_request(messages=messages, images=[p.prepare_image(data)], params=params)]
        )[0]

    own = make_engine()
    ref = [run(own, red), run(own, blue)]
    assert own.stats_snapshot()["vision_tower_images"] == 2
    eng = make_engine()
    asked: list[bytes] = []

    def source(items: list) -> list:
        asked.extend(im.key for im in items)
        # the red image's features from another process's tower; the blue one: not there
        return [
            own.model.vision.encode_pixels([im.pixels])[0] if im.key == asked[0] else None
            for im in items
        ]

    eng.set_feature_source(source)
    got = [run(eng, red), run(eng, blue)]
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert len(asked) == 2 and eng.remote_feature_images == 1
    assert [r.vision_tower_runs for r in got] == [0, 1]
    assert eng.stats_snapshot()["vision_tower_images"] == 1


# ---- the whole process killed mid-batch ------------------------------------------------


def test_a_sigkill_of_the_whole_process_mid_batch_resumes_without_rerunning_lines(
    model_dir: Path, tmp_path: Path
) -> None:
    """``kill -9`` of ``mmserve serve --replicas 2`` itself (Ray's processes share the
    driver's fate) while a batch runs; a restart on the same ``--data-dir`` resumes it:
    the lines answered before the kill keep their records (not run again), only the others
    run on the new replicas (their engines count exactly those), each ``custom_id`` once,
    with the endpoint's online answers."""
    args = (*RAY_ARGS, "--data-dir", str(tmp_path), "--batch-max-in-flight", "2")
    bodies = {
        f"k{i}": {
            "model": MODEL,
            "messages": [user(f"Count to {i % 4} please.")],
            # long enough lines that the kill comes mid-batch: the ingress, which runs the
            # batch, outlives the killed driver (seconds) until its raylet goes
            "max_tokens": 320,
            "ignore_eos": True,
            "temperature": 0,
        }
        for i in range(24)
    }

    def records(path: Path) -> dict[str, str]:
        """custom_id -> the record's line, a torn last line (cut by the kill) left out."""
        got = {}
        for text in path.read_text().splitlines():
            try:
                got[json.loads(text)["custom_id"]] = text
            except ValueError:
                pass
        return got

    with live_server_process(model_dir, *args, timeout=START_TIMEOUT) as (url, proc):
        c = openai_client(url)
        batch = start_batch(c, bodies)
        out_path = tmp_path / "batches" / batch.id / "output.jsonl"
        # read the records on disk, not over HTTP: a loaded machine answers slowly and the
        # whole batch could finish before the kill
        wait_for(
            lambda: out_path.exists() and len(records(out_path)) >= 4,
            120,
            "four lines to finish",
            every=0.05,
        )
        ray = {p: cmdline(p) for p in child_pids(proc.pid)}
        proc.kill()
        proc.wait()
    # GCS and raylet die with the driver, the workers (ingress, replicas) with the raylet;
    # Ray's dashboard and runtime-env agents linger (they try to report to the dead GCS)
    vital = [p for p, cmd in ray.items() if "Agent" not in cmd]
    left = wait_gone(vital, 60)
    for p in wait_gone(list(ray), 0):  # nothing of ours outlives the test
        os.kill(p, signal.SIGKILL)
    assert not left, [ray[p] for p in left]
    d = tmp_path / "batches" / batch.id
    assert json.loads((d / "state.json").read_text())["batch"]["status"] == "in_progress"
    before = records(d / "output.jsonl")
    print(f"{len(before)} of {len(bodies)} lines answered before the kill")
    assert 4 <= len(before) < len(bodies)
    with live_server(model_dir, *args, timeout=START_TIMEOUT) as url:
        c = openai_client(url)
        done = completed_batch(c, batch.id, len(bodies))
        assert done.error_file_id is None
        # the new replicas ran exactly the lines that had no answer on disk
        assert stats(url)["requests_finished"] == len(bodies) - len(before)
        out = [json.loads(t) for t in c.files.content(done.output_file_id).text.splitlines()]
        assert sorted(r["custom_id"] for r in out) == sorted(bodies)  # each exactly once
        after = {r["custom_id"]: r for r in out}
        for cid, text in before.items():  # not rerun: the same record (id, request id, body)
            assert after[cid] == json.loads(text)
        answers = {}
        for r in out:
            prompt = bodies[r["custom_id"]]["messages"][0]["content"][0]["text"]
            answers.setdefault(prompt, set()).add(
                r["response"]["body"]["choices"][0]["message"]["content"]
            )
        for cid in ("k0", "k1", "k2", "k3"):  # one line per distinct prompt: greedy answers
            body = bodies[cid]
            online = chat(url, body["messages"], max_tokens=body["max_tokens"], ignore_eos=True)
            online = online.json()
            prompt = bodies[cid]["messages"][0]["content"][0]["text"]
            assert answers[prompt] == {online["choices"][0]["message"]["content"]}
