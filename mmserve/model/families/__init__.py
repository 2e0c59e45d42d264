"""Model families: what differs between LLaVA variants, behind one small interface.

A family is keyed by ``config.json``'s ``model_type`` and supplies the vision
side (tower, projector, tile packing), how many image tokens an image becomes,
and which checkpoint tensors belong to the vision side. The decoder is our
paged Llama (Mistral and Vicuna decoders are Llama-shaped; Qwen2 adds q/k/v biases). Adding a family
means one new module here (its adapter and its seeded test checkpoints,
:meth:`ModelFamily.test_config`) and one line in :data:`FAMILIES`.
"""

from __future__ import annotations

from mmserve.model.families.base import ModelFamily
from mmserve.model.families.llava import LlavaFamily
from mmserve.model.families.llava_next import LlavaNextFamily
from mmserve.model.families.llava_next_video import LlavaNextVideoFamily
from mmserve.model.families.llava_onevision import LlavaOnevisionFamily

#: ``model_type`` -> family class.
FAMILIES: dict[str, type[ModelFamily]] = {
    LlavaFamily.model_type: LlavaFamily,
    LlavaNextFamily.model_type: LlavaNextFamily,
    LlavaOnevisionFamily.model_type: LlavaOnevisionFamily,
    LlavaNextVideoFamily.model_type: LlavaNextVideoFamily,
}

#: The families' user-facing names (``make-model --family``), in registry order.
FAMILY_NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES.values())

__all__ = ["FAMILIES", "FAMILY_NAMES", "ModelFamily", "family_for", "family_named"]


def family_for(model_type: str | None) -> type[ModelFamily] | None:
    """The family class serving ``model_type``, or None when none does."""
    return FAMILIES.get(model_type or "")


def family_named(name: str | None) -> type[ModelFamily] | None:
    """The family class whose user-facing name (:attr:`ModelFamily.name`) is ``name``."""
    return next((f for f in FAMILIES.values() if f.name == name), None)
