"""What the families' seeded test checkpoints share: the test sizes' widths and two helpers
for their descriptions (:meth:`mmserve.model.families.base.ModelFamily.test_config`).

Plain data; :mod:`mmserve.testing` writes the checkpoints.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmserve.model.families.base import ModelFamily

#: Patch side (pixels) of every test checkpoint's vision tower, as CLIP's and SigLIP's.
TEST_PATCH = 14
#: Widths of the test sizes every family has: "tiny" (~1M parameters, tests) and "small"
#: (~28M, CPU benchmarks); ``vision`` and ``text`` are transformers config arguments of the
#: tower and the decoder.
TEST_WIDTHS: dict[str, dict[str, dict[str, int]]] = {
    "tiny": {
        "vision": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128),
        "text": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, intermediate_size=256, max_position_embeddings=8192),
    },
    "small": {
        "vision": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                       intermediate_size=1024),
        "text": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=2, intermediate_size=1408, max_position_embeddings=8192),
    },
}  # fmt: skip


def size_widths(family: type[ModelFamily], size: str, real: dict[str, dict]) -> dict[str, dict]:
    """A copy of the widths of ``size``: :data:`TEST_WIDTHS`, or the family's ``real`` shapes.

    Raises:
        ValueError: if ``size`` is neither.
    """
    widths = TEST_WIDTHS.get(size) or real.get(size)
    if widths is None:
        raise ValueError(
            f"unknown checkpoint size {size!r} for {family.name}; "
            f"expected one of {', '.join(family.test_sizes)}"
        )
    return copy.deepcopy(widths)


def special_token_ids(tokenizer: dict[str, Any]) -> dict[str, int]:
    """Ids of the special tokens of a test tokenizer description (``"tokenizer"`` of
    ``ModelFamily.test_config``): ``specials`` take 0, 1, ...; a padded vocabulary's ``tail``
    follows its ``regular`` ids."""
    ids = {t: i for i, t in enumerate(tokenizer["specials"])}
    if tokenizer.get("padded"):
        regular, tail = tokenizer["padded"]
        ids.update({t: regular + i for i, t in enumerate(tail)})
    return ids
