"""Where the families' checkpoints keep what our modules hold: one table for the loaders (disk
to ours: ``common/hf.py`` and the families' ``hf.py``) and for the DCP converter (ours to disk:
``engine.tools.convert``).

- Kimi calls the MoE ``block_sparse_moe`` and keeps KDA's gate parameters on the attention
  itself (ours: under ``forget_gate``).
- Experts are stored one by one: Kimi's ``w1`` (gate) / ``w3`` (up) / ``w2`` (down), DeepSeek's
  ``gate_proj`` / ``up_proj`` / ``down_proj``; ours are grouped, ``gate_up_proj`` [E, 2I, D]
  (gate rows first) and ``down_proj`` [E, D, I].
- KDA's short convolutions are ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``; ours is one ``conv1d``
  over q | k | v.
"""

from __future__ import annotations

import re

RENAMES = ((".mlp.", ".block_sparse_moe."), (".forget_gate.", "."))  # (ours, on disk)
FORGET_GATE = ("A_log", "dt_bias", "f_a_proj.weight", "f_b_proj.weight")
# grouped projection -> its per-expert parts, in row order, for each family (Kimi's first)
EXPERT_PARTS = {"gate_up_proj": (("w1", "w3"), ("gate_proj", "up_proj")), "down_proj": (("w2",), ("down_proj",))}
CONV_PARTS = "qkv"

# a per-expert part -> (grouped projection, its place among the parts)
PART_OF = {
    part: (grouped, i)
    for grouped, families in EXPERT_PARTS.items()
    for parts in families
    for i, part in enumerate(parts)
}
EXPERT_KEY = re.compile(rf"^(.*\.mlp\.experts)\.(\d+)\.({'|'.join(PART_OF)})\.weight$")
CONV_KEY = re.compile(rf"^(model\.layers\.\d+\.self_attn)\.([{CONV_PARTS}])_conv1d\.weight$")
GATE_KEY = re.compile(rf"^(model\.layers\.\d+\.self_attn)\.({'|'.join(re.escape(n) for n in FORGET_GATE)})$")


def to_disk(name: str) -> str:
    """Our name as Kimi writes it."""
    for ours, theirs in RENAMES:
        name = name.replace(ours, theirs)
    return name


def disk_names(fqn: str) -> list[str]:
    """The names a module path may have on disk, ours first."""
    out = [fqn]
    for ours, theirs in RENAMES:
        out += [n.replace(ours, theirs) for n in out if ours in n]
    return out + ["model." + n for n in out]
