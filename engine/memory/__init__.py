"""Memory: Swap Core (recompute per block with an op-level cache on the device or the host)."""

from engine.memory.swap_core import OP_CLASSES, SwapCore, apply_swap_core

__all__ = ["OP_CLASSES", "SwapCore", "apply_swap_core"]
