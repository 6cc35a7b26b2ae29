"""The MoE's old import path, kept for engine/trainer.py and engine/training (``Router``) until
they import ``engine.model.common.moe``, where the code lives."""
from engine.model.common.moe import MLP, Experts, MoE, Router, counts_of, situ, swiglu  # noqa: F401
