"""A checkpoint's safetensors tensors, each read from its file only when asked."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mmserve.model.weights import CheckpointError, weight_files

#: safetensors dtype names (the format's header) -> torch dtypes.
_ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}  # fmt: skip


class LazyWeights:
    """The checkpoint's tensors by key, each read from its safetensors file when asked.

    Tensors are read with plain file reads into memory this process owns (not mapped:
    mapped file pages would count as resident and tie the model to files that a rebuild
    may truncate), so loading holds the model plus one tensor, never the checkpoint twice.
    The file layout (an 8-byte little-endian header length, a JSON header of
    ``{name: {dtype, shape, data_offsets}}``, then the data) is safetensors' documented one.

    Raises:
        CheckpointError: for a file whose header cannot be read.
    """

    def __init__(self, model_dir: Path, files: list[str]) -> None:
        self._where: dict[str, tuple[Path, int, dict]] = {}
        for name in files:
            path = model_dir / name
            try:
                with open(path, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    if not 2 <= n <= 100 << 20:
                        raise ValueError(f"header length {n}")
                    header = json.loads(f.read(n))
            except (OSError, ValueError) as exc:
                raise CheckpointError(
                    f"{model_dir}: {name} is not a safetensors file: {exc}"
                ) from exc
            for key, info in header.items():
                if key != "__metadata__":
                    self._where[key] = (path, 8 + n, info)

    def keys(self) -> list[str]:
        """Every tensor name of every shard."""
        return list(self._where)

    def has(self, key: str) -> bool:
        """Whether some shard holds tensor ``key``."""
        return key in self._where

    def shape(self, key: str) -> list[int]:
        """Tensor ``key``'s shape, from the header (nothing read)."""
        return list(self._where[key][2]["shape"])

    def _stored_dtype(self, key: str) -> torch.dtype:
        """The torch dtype tensor ``key`` is stored in.

        Raises:
            CheckpointError: for a dtype safetensors names that torch has no twin for.
        """
        path, _, info = self._where[key]
        stored = _ST_DTYPES.get(info.get("dtype", ""))
        if stored is None:
            raise CheckpointError(f"{path}: tensor {key} has unsupported dtype {info.get('dtype')}")
        return stored

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``key`` (first dimension), as stored, on the CPU:
        only those bytes are read, so a large matrix can be processed a slice at a time.

        Raises:
            CheckpointError: for an unknown dtype or a truncated file.
        """
        path, base, info = self._where[key]
        stored = self._stored_dtype(key)
        shape = list(info["shape"])
        stop = min(stop, shape[0])
        t = torch.empty([max(stop - start, 0), *shape[1:]], dtype=stored)
        row_bytes = t[:1].numel() * t.element_size() if len(t) else 0
        first, end = info["data_offsets"]
        if end - first != shape[0] * row_bytes and len(t):
            raise CheckpointError(f"{path}: tensor {key} has {end - first} bytes for {shape}")
        if not len(t):
            return t
        view = t.view(-1).view(torch.uint8)
        with open(path, "rb") as f:
            f.seek(base + first + start * row_bytes)
            if f.readinto(view.numpy().data) != view.numel():
                raise CheckpointError(f"{path}: truncated at tensor {key}")
        return t

    def get(self, key: str, dtype: torch.dtype | None, device: str) -> torch.Tensor:
        """Tensor ``key``, floating point ones cast to ``dtype`` (None, and always for
        8-bit floats: as stored), on ``device``.

        Raises:
            CheckpointError: for an unknown dtype or a truncated file.
        """
        path, base, info = self._where[key]
        stored = self._stored_dtype(key)
        start, end = info["data_offsets"]
        t = torch.empty(info["shape"], dtype=stored)
        view = t.view(-1).view(torch.uint8) if t.numel() else t.view(torch.uint8)
        if view.numel() != end - start:
            raise CheckpointError(
                f"{path}: tensor {key} has {end - start} bytes for shape {info['shape']}"
            )
        with open(path, "rb") as f:
            f.seek(base + start)
            if f.readinto(view.numpy().data) != end - start:
                raise CheckpointError(f"{path}: truncated at tensor {key}")
        cast = dtype is not None and t.is_floating_point() and t.element_size() > 1
        return t.to(device=device, dtype=dtype if cast else t.dtype)


def read_weights(model_dir: Path) -> LazyWeights:
    """The tensors of ``model_dir``'s safetensors files (:func:`weight_files`), read lazily.

    Raises:
        CheckpointError: no weights, a missing shard or an unreadable header.
    """
    return LazyWeights(model_dir, [p.name for p in weight_files(model_dir)])
