"""One request's page table: its KV page ids in order, in a tensor that grows by appending.

The scheduler edits it like a list (append pages, replace a prefix by the tree's
pages, drop the tail); the attention metadata reads :meth:`PageTable.tensor` without
converting a Python list of every page each step, so the per-step cost of building a
decode batch does not grow with how long its requests have run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


class PageTable:
    """Page ids of one request, stored in an int32 tensor with spare capacity.

    Args:
        pages: initial page ids.
        device: where the tensor lives (the attention backend's device).

    Appending is amortised O(1) (capacity doubles); slicing returns Python lists.
    """

    def __init__(self, pages: Iterable[int] = (), device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._buf = torch.empty(16, dtype=torch.int32, device=self.device)
        # on the CPU a numpy view of the buffer: writes through it cost ~0.5 us, not the
        # ~8 us of a torch index write (a decode step appends one page per request)
        self._host = self._buf.numpy() if self.device.type == "cpu" else None
        self._n = 0
        self.extend(pages)

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PageTable):
            return self.tolist() == other.tolist()
        return isinstance(other, list) and self.tolist() == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PageTable({self.tolist()})"

    def tolist(self) -> list[int]:
        """All page ids as a list (O(length): not for per-step use)."""
        return self._buf[: self._n].tolist()

    def tensor(self, n: int | None = None) -> torch.Tensor:
        """A view of the first ``n`` (default all) page ids, int32 ``[n]``."""
        return self._buf[: self._n if n is None else min(n, self._n)]

    def __getitem__(self, key: slice) -> list[int]:
        if not isinstance(key, slice):
            raise TypeError("PageTable supports slices only")
        start, stop, step = key.indices(self._n)
        return self._buf[start:stop:step].tolist() if stop > start else []

    def __setitem__(self, key: slice, pages: list[int]) -> None:
        """Replace ``[0, len(pages))`` (the only slice assignment the scheduler makes:
        a computed prefix handed over to the tree's pages)."""
        start, stop, _ = key.indices(self._n)
        if start != 0 or stop - start != len(pages):
            raise ValueError("only a same-length prefix can be replaced")
        if pages:
            self._buf[: len(pages)] = torch.tensor(pages, dtype=torch.int32, device=self.device)

    def extend(self, pages: Iterable[int]) -> None:
        """Append page ids."""
        pages = list(pages)
        if not pages:
            return
        need = self._n + len(pages)
        if need > self._buf.numel():
            cap = max(need, 2 * self._buf.numel())
            buf = torch.empty(cap, dtype=torch.int32, device=self.device)
            buf[: self._n] = self._buf[: self._n]
            self._set_buf(buf)
        if self._host is not None:
            self._host[self._n : need] = pages
        else:
            self._buf[self._n : need] = torch.tensor(pages, dtype=torch.int32, device=self.device)
        self._n = need

    def truncate(self, n: int) -> list[int]:
        """Drop every page id after the first ``n``; returns the dropped ids (the caller
        frees them)."""
        n = max(0, min(n, self._n))
        dropped = self._buf[n : self._n].tolist()
        self._n = n
        return dropped

    def _set_buf(self, buf: torch.Tensor) -> None:
        self._buf = buf
        self._host = buf.numpy() if self._host is not None else None

    def append(self, page: int) -> None:
        """Append one page id (a decode step's new page: one scalar write, no list)."""
        if self._n == self._buf.numel():
            buf = torch.empty(2 * self._n, dtype=torch.int32, device=self.device)
            buf[: self._n] = self._buf
            self._set_buf(buf)
        if self._host is not None:
            self._host[self._n] = page
        else:
            self._buf[self._n] = page
        self._n += 1

    def reset(self, pages: Iterable[int] = ()) -> None:
        """Replace every page id by ``pages``."""
        self._n = 0
        self.extend(pages)
