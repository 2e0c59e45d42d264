"""Seeded random checkpoints for tests, benchmarks and the bundled default model.

Not part of the serving path: the engine loads whatever directory it is given, and no
package below the HTTP layer imports this one. Each model family describes its test
checkpoints (``ModelFamily.test_config``); :mod:`mmserve.testing.checkpoints` writes them.
``mmserve make-model`` and the server's default model (``ensure_model``) call in here.
"""

from mmserve.testing.checkpoints import (
    CORPUS_PATH,
    FAMILY_NAMES,
    SIZES,
    ensure_model,
    make_checkpoint,
)
from mmserve.testing.copying import quoting_model

__all__ = [
    "CORPUS_PATH",
    "FAMILY_NAMES",
    "SIZES",
    "ensure_model",
    "make_checkpoint",
    "quoting_model",
]
