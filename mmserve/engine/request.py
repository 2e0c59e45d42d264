"""The engine's private request state: one :class:`Request` per request, touched only
on the engine thread (the front end hands in a :class:`~mmserve.types.EngineRequest`
and reads :class:`~mmserve.types.TokenDelta` messages back)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from mmserve.cache.page_table import PageTable
from mmserve.cache.salt import salted_ids
from mmserve.types import SamplingParams, TokenLogprob, new_rid

if TYPE_CHECKING:
    from mmserve.cache.radix_cache import TreeNode
    from mmserve.engine.sampling import ProcessorState
    from mmserve.engine.spec_decode import SpecState
    from mmserve.structured.compile import GrammarState
    from mmserve.types import TokenDelta
    from mmserve.vision.inputs import ImageSpan


class Request:
    """One generation request as the engine tracks it: the engine thread's private state
    (the front end hands in an :class:`~mmserve.types.EngineRequest` and gets
    :class:`~mmserve.types.TokenDelta` messages back).

    Token bookkeeping (all in tokens): ``cached_len`` came from the radix cache
    at first admission (a retracted request is admitted again, ``admissions``
    counts them); ``computed_len`` have K/V in the pool; ``tree_len`` leading
    positions are backed by tree-owned pages locked through ``last_node``.
    ``pages`` lists the request's page ids in order; ``reserved_pages`` are
    promised for future decode steps. ``grammar`` is the matcher of a constrained
    request (set by the front end), else None. ``processed`` says whether its
    parameters change the logits (:meth:`SamplingParams.has_logits_processors`);
    ``processor_state`` is then the engine's per-request state for that
    (:class:`~mmserve.engine.sampling.ProcessorState`, made on first use).
    ``priority`` is the scheduling class (0 interactive, larger is background; see
    :attr:`~mmserve.types.EngineRequest.priority`).
    """

    def __init__(
        self,
        input_ids: list[int],
        spans: list[ImageSpan],
        params: SamplingParams,
        rid: str | None = None,
        on_update: Callable[[TokenDelta], None] | None = None,
    ) -> None:
        self.rid = rid or new_rid()
        self.input_ids = input_ids
        self.spans = spans
        self.params = params
        self.on_update = on_update
        self.arrival = time.perf_counter()
        self.priority = 0
        self.cache_ns = 0  # cache-salt namespace (mmserve.cache.salt); 0: unsalted
        self.write_through = False  # prompt_cache_retention "24h": pages to disk at release
        self.hold = ""  # a hold id: its prompt stays locked after it ends (EngineRequest.hold)
        self._key_input: list[int] | None = None
        self.output_ids: list[int] = []
        self.emitted = 0  # output ids already handed out in a TokenDelta
        self.pages = PageTable()
        self.reserved_pages = 0
        self.cached_len = 0
        self.admissions = 0
        self.admitted_at = 0.0
        self.admit_len = 0
        self.computed_len = 0
        self.tree_len = 0
        self.last_node: TreeNode | None = None  # set at admission, None while waiting
        self.finish_reason: str | None = None
        self.images_needing_vision = 0
        self.vision_tower_runs = 0
        self.vision_time: tuple[float, float] | None = None  # tower calls: first start, last end
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.logits: list[torch.Tensor] | None = [] if params.return_logits else None
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.generator: torch.Generator | None = None
        self.error: str | None = None
        self.grammar: GrammarState | None = None
        self.processed = params.has_logits_processors()
        self.processor_state: ProcessorState | None = None
        self.spec: SpecState | None = None  # speculative decoding's (made on first draft)

    @property
    def prompt_len(self) -> int:
        """Prompt length in tokens."""
        return len(self.input_ids)

    @property
    def finished(self) -> bool:
        """Whether a finish reason is set."""
        return self.finish_reason is not None

    @property
    def seq_len(self) -> int:
        """Prompt plus output length in tokens (``len(all_ids())`` without building it)."""
        return len(self.input_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        """Prompt followed by output ids (a new list: O(length); hot paths use
        :meth:`ids_slice` and :attr:`seq_len`)."""
        return self.input_ids + self.output_ids

    def key_ids(self) -> list[int]:
        """:meth:`all_ids` as the prefix caches key them: mapped into the request's
        cache-salt namespace (:func:`mmserve.cache.salt.salted_ids`), the same list
        unsalted."""
        if not self.cache_ns:
            return self.all_ids()
        if self._key_input is None:
            self._key_input = salted_ids(self.input_ids, self.cache_ns)
        return self._key_input + salted_ids(self.output_ids, self.cache_ns)

    def key_slice(self, start: int, end: int) -> list[int]:
        """``key_ids()[start:end]`` without mapping or copying the rest of the sequence
        (:meth:`ids_slice` when unsalted)."""
        if not self.cache_ns:
            return self.ids_slice(start, end)
        if self._key_input is None:
            self._key_input = salted_ids(self.input_ids, self.cache_ns)
        n = len(self.input_ids)
        if end <= n:
            return self._key_input[start:end]
        out = salted_ids(self.output_ids[max(start - n, 0) : end - n], self.cache_ns)
        return out if start >= n else self._key_input[start:] + out

    def ids_slice(self, start: int, end: int) -> list[int]:
        """``all_ids()[start:end]`` without copying the rest of the sequence."""
        n = len(self.input_ids)
        if end <= n:
            return self.input_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.input_ids[start:] + self.output_ids[: end - n]
