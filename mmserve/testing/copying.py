"""A random checkpoint edited to quote a text: the workload speculative decoding is for.

A random decoder's greedy output never repeats its prompt, so prompt lookup
(:mod:`mmserve.engine.ngram`) would find nothing to draft. :func:`quoting_model` edits a
loaded model so that its greedy output copies a given passage, as a document-QA answer
that quotes the document does: each decoder layer's output projections (attention
``o_proj`` and MLP ``down_proj``) are zeroed, so the final hidden state is the current
token's normalized embedding, and the LM head's row for each passage token's successor
is set to that token's embedding (scaled far above the random rows), so the argmax after
token ``t`` is the token that follows ``t`` in the passage (a bigram table). Every
layer still runs at full size (the weights are zeros, not removed), so a step costs
what the random checkpoint's does: speed measured on it is the real model shape's.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from mmserve.model.loader import LoadedModel


@torch.no_grad()
def quoting_model(
    model: LoadedModel, passage: list[int], start: int, copy_decoder: bool = True
) -> LoadedModel:
    """A copy of ``model`` (decoder deep-copied; vision and processor shared) whose
    greedy output after token ``start`` is ``passage`` (where the passage repeats a
    token with different successors, the last one wins from there on).

    Args:
        model: a loaded, unquantized model with a :class:`~mmserve.model.llama.LlamaDecoder`.
        passage: the token ids to quote (text ids of the vocabulary).
        start: the token that precedes the quote (the prompt's last token).
        copy_decoder: False edits ``model``'s decoder in place (a real-shape benchmark
            that cannot hold two copies).

    Returns:
        The edited :class:`LoadedModel` (``model`` itself is unchanged unless
        ``copy_decoder`` is False).
    """
    # a LlamaDecoder (nn.Module attributes)
    dec: Any = copy.deepcopy(model.decoder) if copy_decoder else model.decoder
    for layer in dec.layers:
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            lin.weight.zero_()
            if lin.bias is not None:
                lin.bias.zero_()
    emb = dec.embed_tokens.weight
    head = dec.lm_head
    if head.weight is emb:  # tied: untie, the embeddings stay as they are
        head.weight = torch.nn.Parameter(emb.detach().clone())
    w = head.weight
    unit = emb.float() / emb.float().norm(dim=-1, keepdim=True).clamp(min=1e-6)
    scale = 50.0 * float(w.float().norm(dim=-1).max())
    succ = dict(zip([start, *passage[:-1]], passage, strict=True))
    rows: dict[int, torch.Tensor] = {}
    for t, nxt in succ.items():
        rows[nxt] = rows.get(nxt, torch.zeros_like(unit[0])) + unit[t]
    for nxt, v in rows.items():
        w[nxt] = (scale * v).to(w.dtype)
    return dataclasses.replace(model, decoder=dec, identity=None)
