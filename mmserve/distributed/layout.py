"""Which slice of every decoder weight a tensor-parallel rank holds.

Megatron-LM's split (Shoeybi et al., arXiv 1909.08053, Section 3): attention by
heads (q/k/v column-parallel, ``o_proj`` row-parallel), the MLP's ``gate_proj`` /
``up_proj`` by columns and ``down_proj`` by rows, so each block needs one
all-reduce. Grouped-query models with fewer K/V heads than ranks replicate each
K/V head on the ranks whose query heads use it. The LM head is split by vocabulary
rows (``ceil(V / N)`` per rank, the last rank's slice shorter); norms are replicated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mmserve.model.llama import LlamaShape, row_splits


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tp(shape: LlamaShape, tp: int, device: str = "cpu", deterministic: bool = False) -> None:
    """Refuse a tensor-parallel size this model or machine cannot run.

    Args:
        shape: the full decoder's hyperparameters.
        tp: number of ranks.
        device: "cpu", "cuda" or "cuda:0" (ranks use ``cuda:0 .. cuda:tp-1``).
        deterministic: ``--deterministic``: each rank must hold whole blocks of the
            model's fixed reduction splits (:func:`~mmserve.model.llama.row_splits`).

    Raises:
        ValueError: when ``tp`` < 1, does not divide the query heads or the MLP width,
            when K/V heads and ``tp`` divide neither way, under ``deterministic`` when
            ``tp`` does not divide the fixed splits, or (CUDA) when there are fewer
            visible devices than ranks or the device is not ``cuda:0``.
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    h, hkv = shape.num_heads, shape.num_kv_heads
    if h % tp:
        ok = ", ".join(str(d) for d in _divisors(h))
        raise ValueError(
            f"--tp {tp} does not divide the model's {h} query heads; choose one of {ok}"
        )
    if hkv % tp and tp % hkv:
        raise ValueError(
            f"--tp {tp} and the model's {hkv} K/V heads divide neither way (each rank needs "
            "whole K/V heads, or K/V heads replicated evenly)"
        )
    if shape.intermediate_size % tp:
        raise ValueError(
            f"--tp {tp} does not divide the model's MLP width {shape.intermediate_size}"
        )
    splits = row_splits(shape)
    if deterministic and splits % tp:
        ok = ", ".join(str(d) for d in _divisors(splits))
        raise ValueError(
            f"--tp {tp} cannot run --deterministic on this model: its row-parallel "
            f"reductions run in {splits} fixed blocks (the largest power of two, at most 8, "
            f"dividing its {h} query heads and MLP width {shape.intermediate_size}), and each "
            f"rank must hold whole blocks; choose --tp {ok}"
        )
    if tp > 1 and device.startswith("cuda"):
        import torch

        if device not in ("cuda", "cuda:0"):
            raise ValueError(f"with --tp the ranks use cuda:0 .. cuda:{tp - 1}; got {device!r}")
        n = torch.cuda.device_count()
        if tp > n:
            raise ValueError(f"--tp {tp} needs {tp} CUDA devices, but {n} are visible")


@dataclass(frozen=True)
class TPLayout:
    """Rank ``rank``'s share of a decoder split over ``world`` ranks.

    Attributes:
        rank: this rank, in ``0 .. world-1``.
        world: number of ranks ``N``.
        full: the whole decoder's hyperparameters.
    """

    rank: int
    world: int
    full: LlamaShape

    @property
    def heads(self) -> int:
        """Query heads on this rank (``Hq / N``)."""
        return self.full.num_heads // self.world

    @property
    def kv_heads(self) -> int:
        """K/V heads on this rank (``Hkv / N``, or 1 when replicated)."""
        return max(1, self.full.num_kv_heads // self.world)

    @property
    def kv_head_start(self) -> int:
        """First K/V head of this rank (with replication: the head its query heads use)."""
        hkv = self.full.num_kv_heads
        if hkv >= self.world:
            return self.rank * self.kv_heads
        return self.rank // (self.world // hkv)

    def q_rows(self) -> tuple[int, int]:
        """Rows ``[lo, hi)`` of ``q_proj`` (and columns of ``o_proj``) on this rank."""
        d = self.full.head_dim
        return self.rank * self.heads * d, (self.rank + 1) * self.heads * d

    def kv_rows(self) -> tuple[int, int]:
        """Rows ``[lo, hi)`` of ``k_proj`` and ``v_proj`` on this rank."""
        d = self.full.head_dim
        return self.kv_head_start * d, (self.kv_head_start + self.kv_heads) * d

    def mlp_rows(self) -> tuple[int, int]:
        """Rows of ``gate_proj``/``up_proj`` (columns of ``down_proj``) on this rank."""
        n = self.full.intermediate_size // self.world
        return self.rank * n, (self.rank + 1) * n

    @property
    def vocab_per_rank(self) -> int:
        """Rows of the padded LM-head slice every rank gathers (``ceil(V / N)``)."""
        return -(-self.full.vocab_size // self.world)

    def vocab_rows(self) -> tuple[int, int]:
        """Vocabulary rows ``[lo, hi)`` of the LM head on this rank (may be empty)."""
        v, n = self.full.vocab_size, self.vocab_per_rank
        return min(v, self.rank * n), min(v, (self.rank + 1) * n)

    def local_shape(self) -> LlamaShape:
        """The shape this rank's modules are built with: local heads and MLP width;
        hidden size and vocabulary stay whole (the engine masks and samples full rows)."""
        return dataclasses.replace(
            self.full,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            intermediate_size=self.full.intermediate_size // self.world,
        )
