"""The scheduler in three rooms: admission (:mod:`.admission`), the KV manager
(:mod:`.kv_manager`) and jump-forward extends (:mod:`.extend`), orchestrated by
:class:`Scheduler` (:mod:`.core`), which owns the queues."""

from mmserve.engine.scheduler.admission import PrefillBudget
from mmserve.engine.scheduler.core import Scheduler
from mmserve.engine.scheduler.extend import needs_extend
from mmserve.engine.scheduler.kv_manager import KVManager, make_kv_tiers, make_tree

__all__ = [
    "KVManager",
    "PrefillBudget",
    "Scheduler",
    "make_kv_tiers",
    "make_tree",
    "needs_extend",
]
