"""The scheduler package (see :mod:`.core`)."""

from mmserve.engine.scheduler.core import Scheduler, make_kv_tiers, make_tree

__all__ = ["Scheduler", "make_kv_tiers", "make_tree"]
