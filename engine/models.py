"""Base models: the registry of model families (``engine.model.registry``) under the name the
trainer, the workers, the benches and the tests import it by."""
from engine.model.family import BUILTIN_SEED
from engine.model.registry import (BUILTINS, FAMILIES, LOADERS, build_meta, ensure_builtin, load_base, position_limit,
                                   save_base)

__all__ = ["BUILTINS", "BUILTIN_SEED", "FAMILIES", "LOADERS", "build_meta", "ensure_builtin", "load_base",
           "position_limit", "save_base"]
