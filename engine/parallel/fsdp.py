"""``parallelize(model, mesh)``: expert parallel, then FSDP2, in that fixed order.

- Each experts module is ``fully_shard``-ed over its ``edp`` ranks (its tensors are already this
  EP rank's slice), every block of every ``layers`` list over all ranks, then the root (the
  embeddings, the head, the norms, AttnRes, the image encoder) over all ranks. Each block
  prefetches the next one's gather (the previous one's in the backward): communication overlaps
  compute on backends with asynchronous collectives (NCCL streams; gloo's threads).
- Gradients are summed, not averaged (``set_gradient_divide_factor(1)``): the trainer divides each
  rank's loss by the target tokens of the whole step on all ranks, so the sum over ranks is the
  single-process gradient whatever the split, and expert gradients, which already arrive summed
  over the EP group through the all-to-all, need no other factor.

Every parameter then lives on exactly one rank in one piece (a shard of an FSDP DTensor), which
``global_view`` re-labels with its place in the full tensor, for checkpoints and for gathering.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from engine.model.common.moe import Experts, Router
from engine.parallel.expert import shard_experts
from engine.parallel.mesh import Mesh


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the children of every ModuleList named ``layers``."""
    return [
        b
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers"
        for b in m
    ]


def parallelize(model: nn.Module, mesh: Mesh) -> nn.Module:
    shard_experts(model, mesh)
    for m in model.modules():
        if isinstance(m, Experts):
            fully_shard(m, mesh=mesh.edp)
    layers = blocks(model)
    for b in layers:
        fully_shard(b, mesh=mesh.dp)
    fully_shard(model, mesh=mesh.dp)
    # gather the next block while this one computes, both ways: the MoE's all-to-all waits on the
    # host for its counts, which would otherwise hold back the next gather
    sharded = cast("list[FSDPModule]", layers)
    for this, after in zip(sharded, sharded[1:], strict=False):
        this.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([this])
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    for name, buf in model.named_buffers():  # buffers stay whole on every rank: put them on the device
        if buf.device != mesh.device and not buf.is_meta:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, leaf, buf.to(mesh.device))
    return model


def _expert_params(model: nn.Module) -> dict[str, int]:
    """Every parameter under an experts module: its full expert count."""
    out: dict[str, int] = {}
    for path, m in model.named_modules():
        if isinstance(m, Experts):
            shard = getattr(m, "expert_shard", None)
            E = shard.experts if shard is not None else None
            for name, p in m.named_parameters():
                out[f"{path}.{name}"] = E or p.shape[0]
    return out


def global_view(model: nn.Module, mesh: Mesh | None, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (named like the model's parameters: the parameters themselves, or their
    optimizer states) with each shard labelled by its place in the full tensor. Non-expert
    shards already are (FSDP's DTensors over all ranks); an expert shard is FSDP's piece of this
    EP rank's slice, so it becomes a DTensor over the (ep, edp) mesh, sharded on the experts twice."""
    experts = _expert_params(model) if mesh is not None and mesh.ep > 1 else {}
    out = {}
    for name, t in tensors.items():
        E = experts.get(name)
        if E is None or not isinstance(t, DTensor):
            out[name] = t
            continue
        assert mesh is not None  # experts is empty without a mesh
        shape = (E, *t.shape[1:])
        out[name] = DTensor.from_local(
            t.to_local(),
            mesh.experts,
            [Shard(0), Shard(0)],
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )
    return out


def full_tensors(model: nn.Module, mesh: Mesh, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Whole parameters (on the CPU, on every rank; collective): all, or those in ``names``."""
    params = {n: p for n, p in model.named_parameters() if names is None or n in names}
    return {
        n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
        for n, t in global_view(model, mesh, params).items()
    }


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ for sharded parameters on two meshes: each rank holds disjoint pieces, so
    the squared norm is the sum over ranks of the local sums."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), device=device, dtype=torch.float64)
    for g in grads:
        sq += g.double().pow(2).sum()
    dist.all_reduce(sq)
    norm = sq.sqrt().float()
    scale = max_norm / (float(norm) + 1e-6)
    if math.isfinite(float(norm)) and scale < 1:
        for g in grads:
            g.mul_(scale)
    return norm


def sync_router_load(model: nn.Module) -> None:
    """Sum the routers' token counts over all ranks, so every rank moves the biases alike."""
    for m in model.modules():
        if isinstance(m, Router) and m.load is not None:
            dist.all_reduce(m.load)
