"""The replica router under cache salts and ``prompt_cache_key`` (issue 42): trees keyed
per salt; requests with one key stick to one replica while it runs (before prefix
matching). No Ray instance: the router is driven with fake replicas."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")

from mmserve.types import SamplingParams


class _Replica:
    def __init__(self, uid: str, dep: object) -> None:
        from ray.serve._private.common import ReplicaID

        self.replica_id = ReplicaID(uid, dep)
        self.max_ongoing_requests = 100
        self.node_id, self.availability_zone = "node", None
        self.multiplexed_model_ids: set[str] = set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def _router(app: str):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from mmserve.fleet.router import CacheAwareRouter

    dep = DeploymentID(name="EngineReplica", app_name=app)
    router = CacheAwareRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    a, b = _Replica("a", dep), _Replica("b", dep)
    router.update_replicas([a, b])
    return router, [a, b], dep


async def _route(router, cands, ids, rid, salt="", key="") -> str:
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    from mmserve.fleet.protocol import ReplicaRequest

    rr = ReplicaRequest(rid, ids, [], SamplingParams(), cache_salt=salt, prompt_cache_key=key)
    md = RequestMetadata(request_id=rid, internal_request_id=rid)
    pr = PendingRequest(args=[rr], kwargs={}, metadata=md)
    chosen = (await router.choose_replicas(cands, pr))[0][0]
    router.on_request_routed(pr, chosen.replica_id, None)
    return chosen.replica_id.unique_id


def test_salted_prefixes_never_match_another_salt() -> None:
    async def main() -> None:
        router, cands, _ = _router("salt")
        ids = list(range(100))
        first = await _route(router, cands, ids, "r1", salt="alice")
        # bob's same prompt matches nothing: the least-loaded (other) replica, no_match
        assert await _route(router, cands, ids, "r2", salt="bob") != first
        snap = router.snapshot()
        assert snap["by_reason"] == {"no_match": 2}
        assert all(r["matched_tokens"] == 0 for r in snap["replicas"].values())
        # alice again: her prefix, on her replica
        assert await _route(router, cands, ids + [1], "r3", salt="alice") == first
        assert router.snapshot()["by_reason"]["prefix"] == 1

    asyncio.run(main())


def test_prompt_cache_key_sticks_to_one_replica_before_prefix_matching() -> None:
    async def main() -> None:
        router, cands, dep = _router("affinity")
        shared = list(range(200))
        home = await _route(router, cands, shared, "p1")  # the prefix lives on `home`
        other = "b" if home == "a" else "a"
        # a keyed request with another prompt goes somewhere (least loaded: `other`) ...
        assert await _route(router, cands, [7, 7, 7], "k1", key="conv-1") == other
        # ... and the key keeps it there though the prompt's prefix lives on `home`
        assert await _route(router, cands, shared + [1], "k2", key="conv-1") == other
        assert router.snapshot()["by_reason"]["affinity"] == 1
        # the key is scoped by the salt: another tenant's "conv-1" is another key
        await _route(router, cands, shared + [2], "k3", salt="t2", key="conv-1")
        assert router.snapshot()["by_reason"]["affinity"] == 1
        # the replica dies: the key moves on and sticks to the new one
        from ray.serve._private.common import ReplicaID

        router.on_replica_actor_died(ReplicaID(other, dep))
        alive = [r for r in cands if r.replica_id.unique_id != other]
        assert await _route(router, alive, shared, "k4", key="conv-1") == home
        assert await _route(router, alive, [5], "k5", key="conv-1") == home

    asyncio.run(main())
