"""Ray Serve request routers for engine replicas (``--replica-router``).

All three are :class:`ray.serve.request_router.RequestRouter` subclasses, set on the
replica deployment through ``RequestRouterConfig``; Ray Serve builds one inside each
process holding a handle to the replicas (the ingress) and asks it, per request,
which replicas to try (:meth:`choose_replicas`, best rank first).

- :class:`CacheAwareRouter` (``cache``): the SGLang paper's data-parallel routing, as
  in sglang-router. Per replica it keeps an approximate radix tree
  (:class:`~mmserve.fleet.prefix_tree.PrefixTree`) of the token sequences sent to it:
  text ids and image pseudo-ids, which are content hashes every replica derives
  the same way, so a question about an image matches the replica that already
  encoded it and holds its KV. A request goes to the replica with the longest match
  when that covers at least ``cache_threshold`` of the prompt (reason ``prefix``);
  otherwise to the least-loaded replica (``no_match``, ties: the smallest tree, so
  new images spread); but when the load is uneven (the busiest replica has more than
  ``balance_abs_threshold`` requests above the idlest and more than
  ``balance_rel_threshold`` times its load) always to the least-loaded one (``load``).
  Load is the requests this ingress has in flight on each replica. Sequences are kept
  under the model identity the ingress sends (:attr:`ReplicaRequest.model`): a prefix
  routed for one checkpoint never counts as held for another. With the disk KV
  tier (``--kv-disk-dir``, one directory the replicas share) it also keeps one tree of
  every sequence routed to any replica (``disk_tree_tokens``): pages reach the disk when
  a replica evicts them or stops, so a prompt that no replica's tree holds but that
  tree does goes to the least-loaded replica, which loads it from disk (reason
  ``disk``, counted as matched tokens).
- :class:`PowerOfTwoRouter` (``pow2``): Ray Serve's default power-of-two-choices.
- :class:`RoundRobinRouter` (``round_robin``): each replica in turn.

Every router also answers :class:`~mmserve.fleet.protocol.ControlCall` s (stats, flush,
health for one named replica), honours a retry's ``avoid``, counts requests per
replica and reason, and drops a replica's tree when it dies or is removed. The
ingress reads them through :func:`mmserve.fleet.registry.find_router` (same process;
Ray Serve pickles this module by value, so nothing here may hold a lock or other
unpicklable object at module level).
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from mmserve.cache.salt import namespace, salted_ids
from mmserve.fleet import registry
from mmserve.fleet.prefix_tree import PrefixTree
from mmserve.fleet.protocol import ControlCall, ReplicaRequest
from mmserve.lru import LRU

#: Routing reasons counted per replica.
REASONS = ("affinity", "prefix", "disk", "no_match", "load", "pow2", "round_robin")

#: Most ``prompt_cache_key`` -> replica entries a router remembers (LRU beyond it).
MAX_AFFINITY_KEYS = 65536


def _payload(pr: PendingRequest | None) -> ReplicaRequest | ControlCall | None:
    if pr is None:
        return None
    for arg in [*pr.args, *pr.kwargs.values()]:
        if isinstance(arg, (ReplicaRequest, ControlCall)):
            return arg
    return None


def _keyed(model: bytes, ids: Sequence[int], salt: str = "") -> list[int]:
    """``ids`` behind one token standing for ``model`` (:attr:`ReplicaRequest.model`): the
    trees then hold each model's sequences apart, and a prefix recorded for one checkpoint
    never matches a request for another (a negative id like an image pseudo-id; 63 bits
    of the identity). A cache ``salt`` maps the ids into its namespace
    (:func:`~mmserve.cache.salt.salted_ids`): another salt's prefixes never match."""
    head = -1 - (int.from_bytes(model[:8].ljust(8, b"\0"), "little") >> 1)
    return [head, *(salted_ids(ids, namespace(salt)) if salt else ids)]


def _affinity_key(payload: ReplicaRequest | ControlCall | None) -> tuple[str, str] | None:
    """``(salt, prompt_cache_key)`` of a request that names a key, else None (a key is
    scoped by the salt, so two tenants' equal keys are two keys)."""
    if isinstance(payload, ReplicaRequest) and payload.prompt_cache_key:
        return payload.cache_salt, payload.prompt_cache_key
    return None


def _match(tree: PrefixTree | None, keyed: list[int]) -> int:
    """Tokens of ``keyed``'s prompt (its model token not counted) that ``tree`` holds."""
    return max(0, tree.match(keyed) - 1) if tree is not None else 0


def _tokens(tree: PrefixTree | None) -> int:
    """Prompt tokens ``tree`` holds: its size less one model token per model (each is the
    first token of one edge from the root)."""
    return tree.size - len(tree.root.children) if tree is not None else 0


def _uid(replica: RunningReplica | ReplicaID) -> str:
    rid = replica if isinstance(replica, ReplicaID) else replica.replica_id
    return rid.unique_id


class _Tracking:
    """What every router here shares: control calls, ``avoid``, counters, trees.

    Subclasses implement :meth:`_choose`; :class:`CacheAwareRouter` uses the trees.
    """

    #: name in metrics and stats
    policy = ""
    #: whether every answer of :meth:`choose_replicas` already ranks every candidate
    #: (then Ray Serve backs off before asking again); Ray Serve's power-of-two router
    #: widens its choice round by round and says itself when to back off
    backoff_every_round = True

    def initialize_state(
        self,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 16,
        balance_rel_threshold: float = 1.5,
        max_tree_tokens: int = 32768,
        disk_tree_tokens: int = 0,
        **_: object,
    ) -> None:
        """Called by Ray Serve with ``RequestRouterConfig.request_router_kwargs``
        (``disk_tree_tokens``: size of the tree standing for the shared disk KV tier;
        0 = no disk tier)."""
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_tokens = max_tree_tokens
        self._lock = threading.Lock()
        self._trees: dict[str, PrefixTree] = {}
        self._disk = PrefixTree(disk_tree_tokens) if disk_tree_tokens > 0 else None
        self._inflight: dict[str, int] = defaultdict(int)
        self._routed: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._routed_tokens: dict[str, int] = defaultdict(int)
        self._matched_tokens: dict[str, int] = defaultdict(int)
        # request id -> (first-choice replicas, reason, matched tokens) until it is routed;
        # bounded for requests cancelled before being routed
        self._decisions: LRU[str, tuple[set[str], str, int | None]] = LRU(max_items=4096)
        self._owner: dict[str, str] = {}
        # (salt, prompt_cache_key) -> the replica its requests went to
        self._affinity: LRU[tuple[str, str], str] = LRU(max_items=MAX_AFFINITY_KEYS)
        dep = self._deployment_id  # type: ignore[attr-defined]  # RequestRouter's (a mixin)
        registry.register(dep.app_name, dep.name, self)

    # ---- Ray Serve hooks ---------------------------------------------------
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Ranks of replicas to try for ``pending_request`` (best first).

        A control call goes to its target only (none while the target is not
        running: Ray Serve retries, backing off, until the caller gives up; the
        ingress gives up as soon as the target leaves :meth:`replica_ids`); a retry
        never goes back to the replica it avoids unless that is the only one.

        Every answer lets Ray Serve back off before asking again: its routing loop
        asks again at once, without yielding to its event loop, while
        ``routing_context.should_backoff`` is false, so an empty answer (a control
        call for a replica that just died) would spin on that loop, which also
        routes every other request and receives the new replica set: the whole
        endpoint would hang and a replacement replica would never join.
        """
        ranked = await self._ranks(list(candidate_replicas), pending_request)
        if pending_request is not None and (self.backoff_every_round or not ranked):
            pending_request.routing_context.should_backoff = True
        return ranked

    async def _ranks(
        self, cands: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        payload = _payload(pending_request)
        if isinstance(payload, ControlCall):
            if payload.target is None:
                return [self._by_load(cands)] if cands else []
            return [mine] if (mine := [r for r in cands if _uid(r) == payload.target]) else []
        if isinstance(payload, ReplicaRequest) and payload.avoid is not None:
            cands = [r for r in cands if _uid(r) != payload.avoid] or cands
        if not cands:
            return []
        sticky = self._sticky(cands, payload)
        if sticky is not None:  # affinity before prefix matching, while it is running
            rest = [r for r in self._by_load(cands) if r is not sticky]
            ranked, reason, matched = [[sticky], rest], "affinity", None
        else:
            ranked, reason, matched = await self._choose(cands, payload, pending_request)
        ranked = [[r for r in rank if r in cands] for rank in ranked]
        ranked = [rank for rank in ranked if rank]
        if pending_request is not None and ranked:
            key = pending_request.metadata.internal_request_id
            self._decisions.put(key, ({_uid(r) for r in ranked[0]}, reason, matched))
        return ranked

    async def _choose(
        self,
        cands: list[RunningReplica],
        payload: ReplicaRequest | None,
        pending_request: PendingRequest | None,
    ) -> tuple[list[list[RunningReplica]], str, int | None]:
        """``(ranks, reason, tokens the first choice already holds or None)``."""
        raise NotImplementedError

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
        """Count the request on its replica and add its tokens to that replica's tree."""
        super().on_request_routed(pending_request, replica_id, result)  # type: ignore[misc]
        payload = _payload(pending_request)
        key = pending_request.metadata.internal_request_id
        decision = self._decisions.pop(key)
        if not isinstance(payload, ReplicaRequest):
            return
        uid = _uid(replica_id)
        if decision is not None and uid in decision[0]:
            reason, matched = decision[1], decision[2]
        else:  # not the router's first choice (it was full): a load decision
            reason, matched = "load", None
        keyed = _keyed(payload.model, payload.input_ids, payload.cache_salt)
        affinity = _affinity_key(payload)
        if affinity is not None:  # the replica it actually went to holds its cache now
            self._affinity.put(affinity, uid)
        with self._lock:
            approx = self._trees.get(uid)
            if matched is None:
                matched = _match(approx, keyed)
            if approx is not None:
                approx.insert(keyed)
            if self._disk is not None:
                self._disk.insert(keyed)
            self._inflight[uid] += 1
            self._owner[key] = uid
            self._routed[uid][reason] += 1
            self._routed_tokens[uid] += len(payload.input_ids)
            self._matched_tokens[uid] += matched

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The request left its replica: one less in flight there."""
        super().on_request_completed(replica_id, internal_request_id)  # type: ignore[misc]
        self._decisions.pop(internal_request_id)
        with self._lock:
            uid = self._owner.pop(internal_request_id, None)
            if uid is not None:
                self._inflight[uid] = max(0, self._inflight[uid] - 1)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """New replicas get an empty tree; removed ones lose theirs."""
        super().update_replicas(replicas)  # type: ignore[misc]
        alive = {_uid(r) for r in replicas}
        with self._lock:
            for uid in alive - set(self._trees):
                self._trees[uid] = PrefixTree(self.max_tree_tokens)
            for uid in set(self._trees) - alive:
                self._drop(uid)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """A dead replica's tree goes; Ray Serve stops offering it."""
        super().on_replica_actor_died(replica_id)  # type: ignore[misc]
        with self._lock:
            self._drop(_uid(replica_id))

    def _drop(self, uid: str) -> None:
        self._trees.pop(uid, None)
        self._inflight.pop(uid, None)
        for key in [k for k, v in self._owner.items() if v == uid]:
            del self._owner[key]

    # ---- for the ingress -----------------------------------------------------
    def replica_ids(self) -> list[str]:
        """Unique ids of the replicas the router may route to now."""
        return sorted(_uid(r) for r in self.curr_replicas.values())  # type: ignore[attr-defined]

    def record_output(
        self, uid: str, ids: Sequence[int], model: bytes = b"", salt: str = ""
    ) -> None:
        """A finished request's prompt and output are in ``uid``'s cache now (for
        ``model``, :attr:`ReplicaRequest.model`, under cache ``salt``)."""
        keyed = _keyed(model, ids, salt)
        with self._lock:
            approx = self._trees.get(uid)
            if approx is not None:
                approx.insert(keyed)
            if self._disk is not None:
                self._disk.insert(keyed)

    def forget(self, uid: str) -> None:
        """``uid``'s cache was flushed: empty its tree."""
        with self._lock:
            approx = self._trees.get(uid)
            if approx is not None:
                approx.clear()

    def snapshot(self) -> dict:
        """Per replica: requests routed by reason, in flight, tokens routed and already
        held (the router's prediction of cached tokens), tree size; and totals."""
        with self._lock:
            uids = sorted(set(self._trees) | set(self._routed))
            replicas: dict[str, dict[str, Any]] = {}
            for uid in uids:
                approx = self._trees.get(uid)
                routed = self._routed_tokens.get(uid, 0)
                replicas[uid] = {
                    "alive": approx is not None,
                    "in_flight": self._inflight.get(uid, 0),
                    "routed": dict(self._routed.get(uid, {})),
                    "routed_tokens": routed,
                    "matched_tokens": self._matched_tokens.get(uid, 0),
                    "predicted_hit_rate": (
                        self._matched_tokens.get(uid, 0) / routed if routed else 0.0
                    ),
                    "tree_tokens": _tokens(approx),
                }
        by_reason: dict[str, int] = defaultdict(int)
        for info in replicas.values():
            for reason, n in info["routed"].items():
                by_reason[reason] += n
        return {
            "policy": self.policy,
            "by_reason": dict(by_reason),
            "replicas": replicas,
            "disk_tree_tokens": _tokens(self._disk),
        }

    # ---- helpers -------------------------------------------------------------
    def _sticky(
        self, cands: list[RunningReplica], payload: ReplicaRequest | ControlCall | None
    ) -> RunningReplica | None:
        """The replica earlier requests with ``payload``'s ``prompt_cache_key`` went to,
        when it is still a candidate (running, not avoided), else None."""
        key = _affinity_key(payload)
        uid = self._affinity.get(key) if key is not None else None
        if uid is None:
            return None
        return next((r for r in cands if _uid(r) == uid), None)

    def _load(self, r: RunningReplica) -> int:
        return self._inflight.get(_uid(r), 0)

    def _tree_size(self, r: RunningReplica) -> int:
        approx = self._trees.get(_uid(r))
        return _tokens(approx)

    def _by_load(self, cands: list[RunningReplica]) -> list[RunningReplica]:
        """Least loaded first; ties: smallest tree, then replica id."""
        with self._lock:
            return sorted(cands, key=lambda r: (self._load(r), self._tree_size(r), _uid(r)))


class CacheAwareRouter(_Tracking, RequestRouter):
    """Longest cached prefix (text and image tokens) unless the load is uneven."""

    policy = "cache"

    async def _choose(self, cands, payload, pending_request):
        order = self._by_load(cands)
        if not isinstance(payload, ReplicaRequest):
            return [order], "no_match", None
        ids = payload.input_ids
        keyed = _keyed(payload.model, ids, payload.cache_salt)
        with self._lock:
            loads = [self._load(r) for r in order]
            lo, hi = min(loads), max(loads)
            if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
                choice, rest, reason = order[0], order[1:], "load"
            else:
                matches = {}
                for r in order:
                    matches[_uid(r)] = _match(self._trees.get(_uid(r)), keyed)
                best = max(order, key=lambda r: matches[_uid(r)])  # ties: least loaded
                held = matches[_uid(best)]
                on_disk = _match(self._disk, keyed)
                if ids and held and held >= self.cache_threshold * len(ids):
                    choice, reason = best, "prefix"
                    rest = sorted(
                        (r for r in order if r is not best), key=lambda r: -matches[_uid(r)]
                    )
                elif ids and on_disk and on_disk >= self.cache_threshold * len(ids):
                    # every replica can load it from the shared disk: the least loaded
                    choice, rest, reason = order[0], order[1:], "disk"
                else:
                    choice, rest, reason = order[0], order[1:], "no_match"
            # the tree learns the request now, not when the replica has accepted it, so a
            # question about the same new image right behind it follows it
            approx = self._trees.get(_uid(choice))
            matched = _match(approx, keyed)
            if reason == "disk":
                matched = max(matched, on_disk)
            if approx is not None:
                approx.insert(keyed)
            if self._disk is not None:
                self._disk.insert(keyed)
        return [[choice], rest], reason, matched


class RoundRobinRouter(_Tracking, RequestRouter):
    """Each replica in turn (by replica id)."""

    policy = "round_robin"

    async def _choose(self, cands, payload, pending_request):
        if not hasattr(self, "_turn"):
            self._turn = itertools.count()
        order = sorted(cands, key=_uid)
        i = next(self._turn) % len(order)
        return [[order[i]], order[i + 1 :] + order[:i]], "round_robin", None


class PowerOfTwoRouter(_Tracking, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default power-of-two-choices, plus control calls and counters."""

    policy = "pow2"
    backoff_every_round = False

    async def _choose(self, cands, payload, pending_request):
        ranked = await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self, candidate_replicas=cands, pending_request=pending_request
        )
        return ranked, "pow2", None


#: Router class per ``--replica-router`` value.
ROUTER_CLASSES = {
    "cache": CacheAwareRouter,
    "pow2": PowerOfTwoRouter,
    "round_robin": RoundRobinRouter,
}
