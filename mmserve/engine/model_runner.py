"""Runs one forward batch: input embeddings (text + image features), metadata, decoder.

Image features come from the embedding cache when present (the scheduler puts there
the ones the disk KV tier loaded), else from the features the request's item carries
(the front end found them cached; the cache may have evicted them since); otherwise the
items a batch still needs are encoded together from the tower input the front end
prepared (``ImageInput.pixels``), one vision tower call per mode, and queued for the
disk tier if it is on. The engine thread never runs the image processor for a request
the front end built; an item built by hand with only a decoded image is preprocessed
here.

Only positions a request actually computes need features, so an
image fully covered by the prefix match costs nothing, and a match that ends
inside an image takes the tail of that image's features. Reserved pseudo-tokens that
are no image (the video newline) take the fixed embeddings the vision module defines.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from mmserve.cache.kv_pool import KVPool
from mmserve.cache.kv_tiers import KVTiers
from mmserve.engine.cuda_graph import DecodeGraphRunner
from mmserve.engine.request import Request
from mmserve.kernels.metadata import AttentionMetadata, build_metadata
from mmserve.kernels.select import make_attention_backend
from mmserve.model.llama import token_embedding
from mmserve.model.loader import LoadedModel
from mmserve.vision.embedding_cache import EmbeddingCache
from mmserve.vision.inputs import ImageInput


class ModelRunner:
    """Executes prefill and decode batches against the KV pool.

    Args:
        model: loaded checkpoint.
        pool: KV pool.
        embedding_cache: LRU of projected image features.
        device: torch device of the model.
        attention_backend: "auto", "torch" or "flashinfer" (see
            :func:`~mmserve.kernels.select.make_attention_backend`).
        tiers: the KV tiers (None: off); features the tower computes are queued for their
            disk tier (:meth:`~mmserve.cache.kv_tiers.KVTiers.save_features`).
        deterministic: batch- and chunk-invariant attention (``--deterministic``).

    Raises:
        ValueError, BackendUnavailableError: if ``attention_backend`` is unknown
            or cannot run on this device/dtype.

    Attributes:
        graphs: the padded decode runner (:meth:`enable_graphs`), or None: decode eager.
        vision_tower_images: images encoded by the vision tower so far.
        vision_counts: request id -> ``[images needing vision, tower runs]`` found by
            prefills since :meth:`take_vision_counts` last emptied it (the engine
            applies them to its requests: the runner writes no request state).
        vision_times: request id -> ``(start, end)`` ``time.perf_counter()`` of the vision
            tower calls that ran for it (seconds; first start, last end) since
            :meth:`take_vision_times` last emptied it. On CUDA the call is timed as
            launched (no synchronization is added for it).
    """

    def __init__(
        self,
        model: LoadedModel,
        pool: KVPool,
        embedding_cache: EmbeddingCache,
        device: str = "cpu",
        attention_backend: str = "auto",
        tiers: KVTiers | None = None,
        deterministic: bool = False,
    ) -> None:
        self.model = model
        self.tiers = tiers
        self.pool = pool
        self.cache = embedding_cache
        self.device = torch.device(device)
        self.vision_tower_images = 0
        self.vision_counts: dict[str, list[int]] = {}
        self.vision_times: dict[str, tuple[float, float]] = {}
        self.dtype = token_embedding(model.decoder).weight.dtype
        shape = model.decoder.shape
        # The model's actual dtype, not the config's: tests hand in pre-loaded models.
        self.backend = make_attention_backend(
            attention_backend,
            device,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            self.dtype,
            kv_dtype=pool.dtype,
            deterministic=deterministic,
        )
        mask = torch.zeros(model.decoder.shape.vocab_size, dtype=torch.float32)
        mask[model.never_sample_ids] = float("-inf")
        self.logit_mask = mask.to(self.device)
        self.fixed_embeddings = model.vision.token_embeddings()
        self.graphs: DecodeGraphRunner | None = None
        #: where features of items the embedding cache missed are asked for before the
        #: tower runs (a shared encoder service): one ``[tokens, text_hidden]`` tensor or
        #: None (not there: the tower runs here) per item; None = always the tower here
        self.feature_source: Callable[[list[ImageInput]], list[torch.Tensor | None]] | None = None
        #: items whose features :attr:`feature_source` gave (no tower run here)
        self.remote_feature_images = 0

    def enable_graphs(self, max_bs: int, capture: bool) -> DecodeGraphRunner:
        """Run decode batches of at most ``max_bs`` requests padded to a bucket, from CUDA
        graphs captured now when ``capture`` (else eagerly: the CPU twin); see
        :mod:`mmserve.engine.cuda_graph`. Larger batches, prefill and mixed steps stay
        eager.

        Raises:
            ValueError: ``max_bs < 1``.
        """
        shape = self.model.decoder.shape
        max_context = min(shape.max_position_embeddings, self.pool.size_tokens)
        self.graphs = DecodeGraphRunner(
            self.model.decoder, self.backend, self.pool, self.logit_mask, max_bs, max_context,
            capture,
        )  # fmt: skip
        self.graphs.capture()
        return self.graphs

    def _encode(self, images: list[ImageInput]) -> tuple[dict[bytes, torch.Tensor], set[bytes]]:
        """Features ``[num_image_tokens, hidden]`` for each distinct image (or frame): the
        ones its item carries, else :attr:`feature_source`'s, else tower-encoded once from
        its prepared pixels (the family packs each in its mode); and the keys whose
        features :attr:`feature_source` gave (no tower run here).

        Raises:
            ValueError: an item with neither features, pixels for its mode nor a decoded
                image (fails the batch).
        """
        out: dict[bytes, torch.Tensor] = {}
        todo: list[ImageInput] = []
        for im in images:
            if im.features is not None:
                out[im.key] = im.features
            else:
                todo.append(im)
        remote: set[bytes] = set()
        if todo and self.feature_source is not None:
            got = self.feature_source(todo)
            rest = []
            for im, f in zip(todo, got, strict=True):
                if f is None:
                    rest.append(im)
                    continue
                out[im.key] = f = f.to(device=self.device, dtype=self.dtype)
                remote.add(im.key)
                if self.tiers is not None:
                    self.tiers.save_features(im.key, f)
            self.remote_feature_images += len(todo) - len(rest)
            todo = rest
        if todo:
            vision = self.model.vision
            pixels = []
            for im in todo:
                if im.pixels is not None and im.pixels.mode == im.mode:
                    pixels.append(im.pixels)
                elif im.image is not None:  # built by hand, not by the front end
                    pixels.append(self.model.family.preprocess([im.image], im.mode)[0])
                else:
                    raise ValueError(f"image {im.key.hex()} has no pixels for mode {im.mode!r}")
            feats = vision.encode_pixels(pixels)
            self.vision_tower_images += len(todo)
            out.update({im.key: f for im, f in zip(todo, feats, strict=True)})
            if self.tiers is not None:
                for im, f in zip(todo, feats, strict=True):
                    self.tiers.save_features(im.key, f)
        for key, f in out.items():
            self.cache.put(key, f)
        return out, remote

    def take_vision_counts(self) -> dict[str, list[int]]:
        """:attr:`vision_counts` so far, emptied."""
        out, self.vision_counts = self.vision_counts, {}
        return out

    def take_vision_times(self) -> dict[str, tuple[float, float]]:
        """:attr:`vision_times` so far, emptied."""
        out, self.vision_times = self.vision_times, {}
        return out

    def _features(
        self, reqs: list[Request], starts: list[int], ends: list[int]
    ) -> dict[bytes, torch.Tensor]:
        found: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, ImageInput] = {}
        # (request's counts, key, request id) of items the tower or the encoder service gives
        runs: list[tuple[list[int], bytes, str]] = []
        for req, start, end in zip(reqs, starts, ends, strict=True):
            for span in req.spans:
                if span.end <= start or span.start >= end:
                    continue
                counts = self.vision_counts.setdefault(req.rid, [0, 0])
                if start <= span.start or start == req.admit_len:
                    counts[0] += 1  # needing vision: once per admission, not per chunk
                key = span.image.key
                if key in found or key in missing:
                    continue
                f = self.cache.get(key)
                if f is None:
                    missing[key] = span.image
                    if span.image.features is None:  # else the request carries them
                        runs.append((counts, key, req.rid))
                else:
                    found[key] = f
        if missing:
            t0 = time.perf_counter()
            encoded, remote = self._encode(list(missing.values()))
            found.update(encoded)
            t1 = time.perf_counter()
            for counts, key, rid in runs:
                if key not in remote:
                    counts[1] += 1  # a tower run
                self.vision_times[rid] = (self.vision_times.get(rid, (t0,))[0], t1)
        return found

    @torch.inference_mode()
    def prefill(
        self, reqs: list[Request], extends: list[int], drafts: list[list[int]] | None = None
    ) -> torch.Tensor:
        """Compute tokens ``[computed_len, computed_len + extend)`` of each request.

        The tokens are the prompt followed by any output already produced (a
        retracted request resumes that way); image positions take the image's
        projected features, text positions their embeddings.

        Args:
            reqs: requests of the batch.
            extends: new tokens per request (>= 1).
            drafts: speculative decoding's verify step (:mod:`mmserve.engine.spec_decode`):
                per request, drafted text tokens computed after its own new tokens (their
                K/V is written too; the caller keeps only the accepted ones); None: none.

        Returns:
            fp32 logits ``[B, vocab]`` of each request's last new token, with
            never-sampled ids at ``-inf``; with ``drafts``, ``[B + sum(len(d)), vocab]``:
            request ``i``'s last ``1 + len(drafts[i])`` positions, in order.
        """
        starts = [r.computed_len for r in reqs]
        ends = [s + e for s, e in zip(starts, extends, strict=True)]
        feats = self._features(reqs, starts, ends)
        ids_all: list[int] = []
        news = list(extends)
        for i, (r, s, e) in enumerate(zip(reqs, starts, ends, strict=True)):
            ids_all.extend(r.ids_slice(s, e))
            if drafts is not None:
                ids_all.extend(drafts[i])
                news[i] += len(drafts[i])
        meta = self._metadata(reqs, starts, news, ids_all)
        if drafts is not None:  # every drafted position's logits, not only the last
            last = torch.cumsum(torch.tensor(news), 0).tolist()
            rows = [q for n, d in zip(last, drafts, strict=True) for q in range(n - 1 - len(d), n)]
            meta.logit_rows = torch.tensor(rows, dtype=torch.int64).to(self.device)
        ids = meta.input_ids
        assert ids is not None  # given to build_metadata
        embeds = token_embedding(self.model.decoder)(ids.clamp(min=0))
        for tid, vec in self.fixed_embeddings.items():
            embeds[ids == tid] = vec.to(embeds.dtype)
        offset = 0
        for r, s, e, n in zip(reqs, starts, ends, news, strict=True):
            for span in r.spans:
                lo, hi = max(span.start, s), min(span.end, e)
                if lo < hi:
                    f = feats[span.image.key][lo - span.start : hi - span.start]
                    embeds[offset + lo - s : offset + hi - s] = f.to(embeds.dtype)
            offset += n
        return self._run(meta, embeds)

    @torch.inference_mode()
    def decode(self, reqs: list[Request]) -> torch.Tensor:
        """One token for each request; returns logits ``[B, vocab]``: padded and replayed
        through :attr:`graphs` when on and the batch fits its largest bucket."""
        graphs = self.graphs
        if graphs is not None and len(reqs) <= graphs.max_bs:
            return graphs.run(
                [r.pages for r in reqs],
                [r.computed_len + 1 for r in reqs],
                [r.output_ids[-1] for r in reqs],
            )
        prefix = [r.computed_len for r in reqs]
        meta = self._metadata(reqs, prefix, [1] * len(reqs), [r.output_ids[-1] for r in reqs])
        assert meta.input_ids is not None
        return self._run(meta, token_embedding(self.model.decoder)(meta.input_ids))

    def _metadata(
        self, reqs: list[Request], prefix: list[int], extend: list[int], ids: list[int]
    ) -> AttentionMetadata:
        """The step's metadata, token ids and logit rows, in one host-to-device copy."""
        pages: list = [r.pages for r in reqs]  # PageTables: build_metadata reads their tensors
        return build_metadata(pages, prefix, extend, self.pool.page_size, self.device, ids)

    def _run(self, meta: AttentionMetadata, embeds: torch.Tensor) -> torch.Tensor:
        self.backend.plan(meta)
        rows = meta.logit_rows
        assert rows is not None  # build_metadata sets them
        logits = self.model.decoder(embeds, meta.positions, self.backend, self.pool, rows)
        return logits + self.logit_mask
