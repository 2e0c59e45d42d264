"""Content keys of KV pages: the model fingerprint, the namespace and the page key chain.

A page's key is a hash chain (xxHash XXH3-128): the key of page
``i`` is ``XXH3_128(key(i-1) || int64 bytes of its P token ids)``, and the chain
starts from a root key that hashes the *namespace*: the model's identity
(:func:`mmserve.model.identity.model_identity`: every byte of its weight, config,
tokenizer and processor files, its dtype and quantization; :func:`model_fingerprint`
for a model built in memory), the KV dtype, the page
size and the KV layout (with an fp8 pool's per-layer scales). A key therefore names
the KV of a whole prefix on one checkpoint; image pseudo-token ids are content hashes,
so images are included. Two checkpoints, KV dtypes (bf16 and fp8 pages never mix) or
page sizes never share a key, and the disk tier also puts each namespace in its own
directory and writes it in every file header.

The same keys name pages in the host tier, the disk tier's files
(:mod:`mmserve.cache.kv_tiers.disk`) and the radix tree's nodes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
import xxhash

#: Bumped whenever the file layout or the key derivation changes.
FORMAT_VERSION = 2


def model_fingerprint(config_text: str, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """Identity of a model held in memory: 16 bytes of XXH3-128 over its config and every
    byte of every tensor.

    Every element counts: two models that differ in one weight anywhere (an embedding row
    that a strided sample would skip, the last byte of a large tensor) get different
    fingerprints. A model loaded from files is identified by its files instead
    (:func:`mmserve.model.identity.checkpoint_digest`, remembered across restarts).

    Args:
        config_text: the model config serialized as text (e.g. ``config.to_json_string()``),
            plus anything else that changes its outputs.
        named_tensors: ``(name, tensor)`` pairs (any device, any dtype; order matters).

    Returns:
        16-byte digest.
    """
    h = xxhash.xxh3_128()
    h.update(config_text.encode())
    for name, t in named_tensors:
        h.update(f"|{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        flat = t.detach().reshape(-1)
        if flat.numel():
            h.update(flat.contiguous().view(torch.uint8).cpu().numpy().data)
    return h.digest()


def kv_namespace(fingerprint: bytes, dtype: torch.dtype, page_size: int, layout: Sequence) -> bytes:
    """Namespace of KV pages: model identity, KV dtype, page size and layout (16 bytes).

    Args:
        fingerprint: the model's identity
            (:func:`mmserve.model.identity.model_identity`).
        dtype: KV pool dtype.
        page_size: tokens per page ``P``.
        layout: anything else that changes a page's bytes, e.g.
            ``("NHD", num_layers, num_kv_heads, head_dim)``.
    """
    text = f"v{FORMAT_VERSION}|{dtype}|P={page_size}|{tuple(layout)}".encode()
    return xxhash.xxh3_128_digest(fingerprint + text)


class PageKeyChain:
    """Content keys of pages: ``key(i) = XXH3_128(key(i-1) || int64 token ids of page i)``.

    Args:
        namespace: :func:`kv_namespace` bytes; the chain's root key hashes it, so keys of
            different checkpoints, dtypes or page sizes never collide.
        page_size: tokens per page ``P``.
    """

    def __init__(self, namespace: bytes, page_size: int) -> None:
        self.page_size = page_size
        self.root = xxhash.xxh3_128_digest(b"root|" + namespace)

    def chain(self, parent: bytes, tokens: Sequence[int]) -> list[bytes]:
        """Keys of the full pages of ``tokens`` following the page keyed ``parent``.

        Args:
            parent: key of the page before ``tokens`` (:attr:`root` at the start).
            tokens: token ids (text ids >= 0, image pseudo-ids negative int64); a trailing
                partial page is ignored.

        Returns:
            ``len(tokens) // P`` keys of 16 bytes each.
        """
        P = self.page_size
        n = len(tokens) // P
        if n == 0:
            return []
        raw = np.asarray(tokens[: n * P], dtype=np.int64).tobytes()
        step = 8 * P
        out = []
        h = parent
        digest = xxhash.xxh3_128_digest
        for i in range(0, n * step, step):
            h = digest(h + raw[i : i + step])
            out.append(h)
        return out
