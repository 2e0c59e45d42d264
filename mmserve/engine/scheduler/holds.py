"""Held prefixes: radix-tree nodes kept locked under a hold id after their request ended.

A request with a hold id (:attr:`~mmserve.types.EngineRequest.hold`) prefills its prompt;
when it finishes, the tree node of its prompt's full pages is locked here under that id
instead of being unlocked, so the prefix cannot be evicted until the front end releases
it (``EngineCore.release_hold``). One id names one prefix: a newer held request with the
same id locks its own node first, then the older node is unlocked (a stream's prefix
grows frame by frame and is never unlocked in between). Only the scheduler package
touches the tree's locks; this room is the scheduler's.
"""

from __future__ import annotations

from mmserve.cache.no_prefix_cache import PrefixCache
from mmserve.cache.radix_cache import TreeNode


class Holds:
    """Hold id -> the locked tree node of its prefix.

    Args:
        tree: the prefix cache whose nodes are locked.
    """

    def __init__(self, tree: PrefixCache) -> None:
        self.tree = tree
        self._nodes: dict[str, tuple[TreeNode, int]] = {}  # id -> (node, tokens)

    def take(self, hold: str, node: TreeNode, tokens: int) -> None:
        """Lock ``node`` (``tokens`` long from the root) under ``hold``, then unlock the
        node that id held before, if any."""
        self.tree.inc_lock_ref(node)
        old = self._nodes.get(hold)
        self._nodes[hold] = (node, tokens)
        if old is not None:
            self.tree.dec_lock_ref(old[0])

    def release(self, hold: str) -> bool:
        """Unlock the prefix held under ``hold`` (its pages become evictable).

        Returns:
            Whether ``hold`` held one (False for an unknown or released id).
        """
        got = self._nodes.pop(hold, None)
        if got is None:
            return False
        self.tree.dec_lock_ref(got[0])
        return True

    def release_all(self) -> int:
        """Unlock every held prefix (a cache flush); returns how many there were."""
        n = len(self._nodes)
        for hold in list(self._nodes):
            self.release(hold)
        return n

    def tokens(self, hold: str) -> int:
        """Tokens of the prefix held under ``hold`` (0: none)."""
        got = self._nodes.get(hold)
        return got[1] if got is not None else 0

    def __len__(self) -> int:
        return len(self._nodes)
