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
from torch import nn

from mmserve.cache.kv_pool import KVPool
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
    """Root-mean-square layer norm (Zhang & Sennrich, arXiv 1910.07467), computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Multi-head self-attention with GQA and RoPE over the paged pool."""

    def __init__(self, s: LlamaShape, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.h, self.hkv, self.d = s.num_heads, s.num_kv_heads, s.head_dim
        self.q_proj = nn.Linear(s.hidden_size, self.h * self.d, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.hidden_size, self.hkv * self.d, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.hidden_size, self.hkv * self.d, bias=s.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, s.hidden_size, bias=s.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        pool: KVPool,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.h, self.d)
        k = self.k_proj(x).view(t, self.hkv, self.d)
        v = self.v_proj(x).view(t, self.hkv, self.d)
        c, s_ = cos[:, None, :], sin[:, None, :]
        q = q * c + _rotate_half(q) * s_
        k = k * c + _rotate_half(k) * s_
        o = backend.forward(q, k, v, self.layer_id, pool)
        return self.o_proj(o.reshape(t, self.h * self.d))


class MLP(nn.Module):
    """SiLU-gated feed-forward block (Shazeer, arXiv 2002.05202)."""

    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=s.mlp_bias)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=s.mlp_bias)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=s.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, s: LlamaShape, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(s, layer_id)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, x, cos, sin, backend, pool) -> torch.Tensor:  # noqa: ANN001
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend, pool)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaDecoder(nn.Module):
    """Llama decoder with LM head; parameter names match transformers' ``LlamaModel``
    (and ``Qwen2Model``, which differs only in its q/k/v biases).

    Args:
        shape: hyperparameters (see :class:`LlamaShape`).
    """

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape, i) for i in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one tensor, as transformers ties
        # on the CPU even when the module is built on the meta device (the loader does)
        steps = torch.arange(0, shape.head_dim, 2, dtype=torch.float, device="cpu")
        inv_freq = 1.0 / (shape.rope_theta ** (steps / shape.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # A plain attribute, so ``.to(dtype=bfloat16)`` cannot round it: bf16 inverse
        # frequencies put RoPE angles off by ~pos * 2**-9 rad. transformers keeps them fp32.
        self._inv_freq_fp32 = inv_freq

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin tables ``[T, head_dim]`` for int64 ``positions`` ``[T]``."""
        if self._inv_freq_fp32.device != positions.device:
            self._inv_freq_fp32 = self._inv_freq_fp32.to(positions.device)
        freqs = positions[:, None].float() * self._inv_freq_fp32[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

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
        cos, sin = self.rope(positions, embeds.dtype)
        x = embeds
        for layer in self.layers:
            x = layer(x, cos, sin, backend, pool)
        x = self.norm(x[logit_rows])
        return self.lm_head(x).float()
