"""Llama decoder that reads and writes a paged KV pool.

Same arithmetic as transformers' ``LlamaModel`` (RMSNorm in fp32, rotate-half
RoPE, SiLU-gated MLP, grouped-query attention), so a checkpoint's weights load
unchanged, but attention goes through an attention backend over paged K/V
(:mod:`mmserve.kernels`) instead of a dense per-request cache.
Reference: Touvron et al., "LLaMA" (arXiv 2302.13971), Section 2.2;
Su et al., "RoFormer" (arXiv 2104.09864) for RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.cache.kv_pool import KVPool
from mmserve.kernels import batch_invariant, ops
from mmserve.kernels.backend import AttentionBackend


@dataclass
class LlamaShape:
    """Decoder hyperparameters read from a checkpoint's ``text_config``.

    ``qkv_bias`` / ``o_bias``: biases on the q/k/v and on the output projections (Llama's
    ``attention_bias`` sets both; Qwen2 has q/k/v biases only). ``tie_word_embeddings``:
    the LM head is the token embedding matrix (Qwen2-0.5B).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, arXiv 1910.07467), computed in fp32.

    Called with a ``residual``, it adds it first and returns ``(normed, new residual)``
    (:func:`~mmserve.kernels.ops.fused_add_rms_norm`, which may overwrite both inputs).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Linear(nn.Linear):
    """``nn.Linear``, batch-invariant under ``--deterministic``
    (:func:`~mmserve.kernels.batch_invariant.linear`): ``qkv_proj``, ``gate_up_proj``
    and the LM head."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, in]`` -> ``[T, out]`` (same dtype)."""
        if batch_invariant.invariant_linears_on():
            return batch_invariant.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RowLinear(nn.Linear):
    """A linear layer whose reduction ``--deterministic`` cuts into ``splits`` fixed
    blocks (``o_proj`` and ``down_proj``: the layers tensor parallelism splits by input
    features), so one rank computes them as ``N`` ranks together do
    (:func:`~mmserve.kernels.batch_invariant.split_partials`; the model dtype's sum,
    rounded once, then the bias). Otherwise ``nn.Linear`` exactly.

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        splits: blocks of the input features (a power of two dividing ``in_features``;
            :func:`~mmserve.kernels.batch_invariant.reduction_splits`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, splits: int) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.splits = splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, in]`` -> ``[T, out]`` (same dtype)."""
        if not batch_invariant.invariant_linears_on():
            return F.linear(x, self.weight, self.bias)
        y = batch_invariant.split_partials(x, self.weight, self.splits).to(x.dtype)
        return y if self.bias is None else y + self.bias


def row_splits(s: LlamaShape) -> int:
    """The fixed splits of ``s``'s row-parallel reductions under ``--deterministic``
    (``s``: the whole decoder's shape)."""
    return batch_invariant.reduction_splits(s.num_heads, s.intermediate_size)


class Attention(nn.Module):
    """Multi-head self-attention with GQA and RoPE over the paged pool.

    q, k and v are one matmul: ``qkv_proj``'s rows are ``q_proj``'s, then ``k_proj``'s,
    then ``v_proj``'s (the loader concatenates the checkpoint's three).
    """

    def __init__(self, s: LlamaShape, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.h, self.hkv, self.d = s.num_heads, s.num_kv_heads, s.head_dim
        self.qkv_proj = Linear(s.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=s.qkv_bias)
        self.o_proj = RowLinear(self.h * self.d, s.hidden_size, s.o_bias, row_splits(s))

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope_cache: torch.Tensor,
        backend: AttentionBackend,
        pool: KVPool,
    ) -> torch.Tensor:
        t, nq, nkv = x.shape[0], self.h * self.d, self.hkv * self.d
        q, k, v = self.qkv_proj(x).split((nq, nkv, nkv), dim=-1)
        ops.apply_rope(positions, q, k, self.d, rope_cache)
        o = backend.forward(
            q.view(t, self.h, self.d),
            k.view(t, self.hkv, self.d),
            v.view(t, self.hkv, self.d),
            self.layer_id,
            pool,
        )
        return self.o_proj(o.reshape(t, nq))


class MLP(nn.Module):
    """SiLU-gated feed-forward block (Shazeer, arXiv 2002.05202); ``gate_up_proj``'s rows
    are ``gate_proj``'s then ``up_proj``'s."""

    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.gate_up_proj = Linear(s.hidden_size, 2 * s.intermediate_size, bias=s.mlp_bias)
        self.down_proj = RowLinear(s.intermediate_size, s.hidden_size, s.mlp_bias, row_splits(s))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual.

    The residual stream is carried between layers, so each block's add is fused into the
    next norm: ``forward(x, residual)`` takes the previous block's output ``x`` and the
    stream before it (None on the first layer: ``x`` is then the stream itself) and
    returns ``(mlp output, residual)``; the stream after the layer is their sum.
    """

    def __init__(self, s: LlamaShape, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(s, layer_id)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, x, residual, positions, rope_cache, backend, pool):
        if residual is None:  # a copy: the fused add may write into it, x is the caller's
            residual, h = x.clone(), self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rope_cache, backend, pool)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderStack(nn.Module):
    """The layer loop, final norm and LM head: what :class:`LlamaDecoder` and a
    tensor-parallel rank's :class:`~mmserve.distributed.shard.ShardedDecoder` share.

    Subclasses build the modules and the fp32 RoPE table declared here.

    Attributes:
        shape: the decoder's shape (a shard's: its local heads and MLP width).
        embed_tokens: the token embedding (None on a tensor-parallel worker rank, which
            gets the embedded batch from rank 0).
    """

    shape: LlamaShape
    embed_tokens: nn.Embedding | None
    layers: nn.ModuleList
    norm: RMSNorm
    lm_head: nn.Module  # nn.Linear, or a QuantizedLinear once quantized
    _rope_cache: torch.Tensor

    def rope_cache(self, device: torch.device) -> torch.Tensor:
        """fp32 cos/sin table ``[max_position_embeddings, head_dim]``
        (:func:`~mmserve.kernels.ops.cos_sin_cache`), built once, moved to ``device`` on
        first use."""
        if self._rope_cache.device != device:
            self._rope_cache = self._rope_cache.to(device)
        return self._rope_cache

    @torch.inference_mode()
    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        pool: KVPool,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Run the decoder on a packed batch of new tokens.

        Args:
            embeds: ``[T, hidden]`` input embeddings (text embeddings with image
                features already scattered in).
            positions: int64 ``[T]`` absolute positions.
            backend: attention backend, already planned for this batch.
            pool: KV pool; the new tokens' K/V are written into it.
            logit_rows: int64 ``[B]`` rows of the batch whose logits are wanted
                (each request's last new token).

        Returns:
            fp32 logits ``[B, vocab_size]`` (run by a tensor-parallel shard: its own rows
            of the vocabulary; ``gather_logits`` pads and joins the ranks' slices).
        """
        cache = self.rope_cache(embeds.device)
        x, residual = embeds, None
        # the fused norm/RoPE/SiLU ops follow the attention backend (no FlashInfer
        # kernel at all under --attention-backend torch), and so do the invariant linears
        with (
            ops.fused_ops(backend.name == "flashinfer"),
            batch_invariant.invariant_linears(getattr(backend, "deterministic", False)),
        ):
            for layer in self.layers:
                x, residual = layer(x, residual, positions, cache, backend, pool)
            assert residual is not None  # a decoder has at least one layer
            x, _ = self.norm(x[logit_rows], residual[logit_rows])
        return self.lm_head(x).float()


def token_embedding(decoder: DecoderStack) -> nn.Embedding:
    """``decoder.embed_tokens`` where tokens are embedded: the engine's process (the only
    one, or rank 0 under tensor parallelism; worker ranks get the embedded batch).

    Raises:
        AssertionError: on a tensor-parallel worker rank, which holds no embedding.
    """
    embedding = decoder.embed_tokens
    assert embedding is not None, "a tensor-parallel worker rank embeds no tokens"
    return embedding


class LlamaDecoder(DecoderStack):
    """Llama decoder with LM head; parameter names match transformers' ``LlamaModel``
    (and ``Qwen2Model``, which differs only in its q/k/v biases).

    Args:
        shape: hyperparameters (see :class:`LlamaShape`).
    """

    embed_tokens: nn.Embedding  # always held here

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape, i) for i in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one tensor, as transformers ties
        # on the CPU even when the module is built on the meta device (the loader does)
        self._inv_freq_fp32 = ops.rope_inv_freq(shape.head_dim, shape.rope_theta)
        # Plain attributes, so ``.to(dtype=bfloat16)`` cannot round them: bf16 inverse
        # frequencies put RoPE angles off by ~pos * 2**-9 rad. transformers keeps them fp32.
        self._rope_cache = ops.cos_sin_cache(self._inv_freq_fp32, shape.max_position_embeddings)
