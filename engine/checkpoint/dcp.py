"""Sharded training checkpoints in torch.distributed.checkpoint (DCP) format: every rank writes
its own shards, each labelled with its place in the full tensor (``global_view``), so a load
on any other world size or EP size reads exactly the pieces it needs (DCP reshards on load).

Layout of a checkpoint folder: ``model`` (the trainable parameters, or all of them and
the persistent buffers under ``buffers`` with ``everything``) and ``optim`` (AdamW's ``exp_avg``,
``exp_avg_sq`` and ``step`` per parameter, keyed by parameter name), both under the parameter
names of the module tree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from engine.parallel.fsdp import global_view
from engine.parallel.mesh import Mesh

_ADAM = ("exp_avg", "exp_avg_sq")


def _params(model: nn.Module, everything: bool) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if everything or p.requires_grad}


def _state(model: nn.Module, mesh: Mesh | None, opt: torch.optim.Optimizer | None, everything: bool) -> dict:
    params = _params(model, everything)
    state: dict[str, Any] = {"model": global_view(model, mesh, params)}
    if everything:  # the routers' balancing biases too (whole on every rank)
        keys = set(model.state_dict())
        state["buffers"] = {n: b for n, b in model.named_buffers() if n in keys}
    if opt is not None:
        by_id = {id(p): n for n, p in params.items()}
        fused = all(g.get("fused") for g in opt.param_groups)  # its step counts on the device, fp32
        for p in params.values():  # a fresh optimizer has no state yet: give it AdamW's, zeroed
            if p.requires_grad and not opt.state[p]:
                step = torch.zeros((), dtype=torch.float32, device=p.device) if fused else torch.tensor(0.0)
                opt.state[p].update(step=step, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        states = {by_id[id(p)]: s for p, s in opt.state.items() if id(p) in by_id}
        state["optim"] = {k: global_view(model, mesh, {n: s[k] for n, s in states.items()}) for k in _ADAM}
        state["optim"]["step"] = {n: s["step"] for n, s in states.items()}
    return state


def save(
    folder: Path,
    model: nn.Module,
    mesh: Mesh | None,
    opt: torch.optim.Optimizer | None = None,
    everything: bool = False,
) -> None:
    """Collective: every rank calls it with the same folder (a file system all ranks see)."""
    dcp.save(_state(model, mesh, opt, everything), checkpoint_id=str(folder))


def load(
    folder: Path,
    model: nn.Module,
    mesh: Mesh | None,
    opt: torch.optim.Optimizer | None = None,
    everything: bool = False,
) -> None:
    """Read a checkpoint written by ``save`` on any world size and EP size into this rank's
    shards, in place."""
    state = _state(model, mesh, opt, everything)
    dcp.load(state, checkpoint_id=str(folder))
    if opt is not None:  # the step counters are plain tensors: DCP may have replaced them
        named = _params(model, everything)
        for n, step in state["optim"]["step"].items():
            opt.state[named[n]]["step"] = step
