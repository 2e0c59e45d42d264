"""Orders of the waiting queue.

``lpm`` and ``dfs-weight`` are the cache-aware orders of the SGLang paper
(arXiv 2312.07104, Section 3, "Cache-aware scheduling" and Appendix A.3's
DFS-weight); ``fcfs`` and ``random`` ignore the cache. Requests are ordered by
priority class first (``Request.priority``, smaller first: interactive traffic ahead of
batch jobs), by the policy inside each class. A request that has waited longer than
the starvation bound goes first whatever the policy and its class, so background work
advances under a steady interactive load.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from mmserve.cache.radix_cache import MatchResult, TreeNode
from mmserve.engine.request import Request


def order_waiting(
    items: Sequence[tuple[Request, MatchResult]],
    policy: str,
    now: float,
    max_wait: float,
    rng: random.Random,
    cache_on: bool,
) -> list[tuple[Request, MatchResult]]:
    """Sort waiting requests for admission: the starved ones (oldest first), then each
    priority class in turn (smallest ``priority`` first), in ``policy``'s order.

    Args:
        items: ``(request, its current prefix match)`` in arrival order; each request has
            ``arrival`` (seconds) and ``priority`` (int).
        policy: "lpm", "dfs-weight", "fcfs" or "random".
        now: current ``time.perf_counter()`` (seconds).
        max_wait: starvation bound (seconds); older requests come first, oldest first.
        rng: source of the "random" order.
        cache_on: cache-aware policies fall back to FCFS when False.

    Returns:
        The items in admission order.
    """
    starved = [it for it in items if now - it[0].arrival > max_wait]
    classes: dict[int, list[tuple[Request, MatchResult]]] = {}
    for it in items:
        if now - it[0].arrival <= max_wait:
            classes.setdefault(it[0].priority, []).append(it)
    out = starved
    for priority in sorted(classes):
        out += _by_policy(classes[priority], policy, rng, cache_on)
    return out


def _by_policy(
    rest: list[tuple[Request, MatchResult]], policy: str, rng: random.Random, cache_on: bool
) -> list[tuple[Request, MatchResult]]:
    if policy == "random":
        rng.shuffle(rest)
    elif cache_on and policy == "lpm":
        rest.sort(key=lambda it: -it[1].length)  # stable: FCFS among equal matches
    elif cache_on and policy == "dfs-weight":
        rest = _dfs_weight(rest)
    return rest


def _dfs_weight(items: list[tuple[Request, MatchResult]]) -> list[tuple[Request, MatchResult]]:
    # weight(node) = waiting requests whose match ends in node's subtree
    weight: dict[int, int] = {}
    at_node: dict[int, list[tuple[Request, MatchResult]]] = {}
    root: TreeNode | None = None
    for it in items:
        node: TreeNode | None = it[1].last_node
        at_node.setdefault(id(node), []).append(it)
        while node is not None:
            weight[id(node)] = weight.get(id(node), 0) + 1
            root = node
            node = node.parent
    if root is None:
        return items
    # Post-order: a node's subtrees (heaviest first) before the requests that match
    # only the node itself, so a request extending a cached path runs before one
    # that would evict it (SGLang's DFS-weight priority).
    out: list[tuple[Request, MatchResult]] = []
    stack: list[tuple[TreeNode, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            out.extend(at_node.get(id(node), ()))
            continue
        stack.append((node, True))
        kids = [c for c in node.children.values() if id(c) in weight]
        kids.sort(key=lambda c: weight[id(c)])  # heaviest pushed last, popped first
        stack.extend((c, False) for c in kids)
    return out
