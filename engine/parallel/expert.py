"""Expert parallel: each of the ``ep`` ranks of an EP group keeps E / ep experts (a slice of
every grouped expert tensor, LoRA factors included), and every MoE layer sends each token's
hidden state to the ranks that own its chosen experts and back by two all-to-alls.

The forward of a sharded experts module (Legend: N tokens, K experts per token, E experts,
L = E / ep local experts, M rows received):
1. sort the N*K (token, slot) assignments by expert (stable, so tokens stay in order), count
   them per expert and swap the counts with one all-to-all: rank j learns how many rows each
   rank sends to each of its L experts;
2. all-to-all the rows (autograd-aware: the backward is the reverse exchange);
3. regroup the M received rows by local expert, run the local experts (``Experts.grouped``:
   every one of them, even on zero rows, so every rank produces a gradient for every shard:
   FSDP's reduce-scatter needs the same set on all ranks), put the rows back in arrival order;
4. all-to-all the results back (weighed already: the router's weights travel with the rows, and
   the experts weigh their rows) and add them into the tokens.
The sums into each token run in the same order as the single-device loop (expert by expert,
tokens ascending), so ep=1 and ep>1 add the same terms in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MethodType

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from engine.model.common.layers import autocast_input
from engine.model.common.moe import Experts
from engine.parallel.mesh import Mesh


@dataclass
class ExpertShard:
    group: dist.ProcessGroup
    size: int  # ep
    rank: int  # rank in the EP group: owns experts [rank * L, (rank + 1) * L)
    experts: int  # E, all of them


def _exchange(x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    return all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)


def _forward(self: Experts, x_ND: torch.Tensor, idx_NK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    ep: ExpertShard = self.expert_shard  # type: ignore[assignment]  # set by shard_experts below
    L = ep.experts // ep.size
    K = idx_NK.shape[1]
    flat = idx_NK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    counts = torch.bincount(flat, minlength=ep.experts)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=ep.group)  # [ep * L]: what each rank sends to each of mine
    got_EL = got.view(ep.size, L)
    send, recv = counts.view(ep.size, L).sum(1).tolist(), got_EL.sum(1).tolist()
    rows = _exchange(autocast_input(x_ND)[tok], recv, send, ep.group)  # bf16 under autocast: half the bytes
    weights = _exchange(w_NK.reshape(-1)[order], recv, send, ep.group)  # the experts weigh their rows
    local = torch.repeat_interleave(torch.arange(L, device=got.device).repeat(ep.size), got_EL.flatten())
    regroup = torch.argsort(local, stable=True)
    y = self.grouped(rows[regroup], got_EL.sum(0), weights[regroup])
    back = _exchange(y[torch.argsort(regroup)], send, recv, ep.group)
    return torch.zeros_like(x_ND).index_add_(0, tok, back.to(x_ND.dtype))


def shard_experts(model: nn.Module, mesh: Mesh) -> None:
    """Keep this rank's slice of every experts module (its tensors and its LoRA factors: all of
    them have the experts first) and route its forward through the all-to-alls. A no-op when
    ``ep`` is 1."""
    if mesh.ep == 1:
        return
    for path, module in model.named_modules():
        if not isinstance(module, Experts):
            continue
        E = module.gate_up_proj.shape[0]
        if E % mesh.ep:
            raise ValueError(f"parallel.ep_size {mesh.ep} must divide the number of experts ({E}) of {path}")
        L, r = E // mesh.ep, mesh.ep_rank
        for name, p in list(module.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            target = module.get_submodule(owner) if owner else module
            setattr(target, leaf, nn.Parameter(p.detach()[r * L : (r + 1) * L].clone(), requires_grad=p.requires_grad))
        module.expert_shard = ExpertShard(mesh.ep_group, mesh.ep, r, E)  # type: ignore[assignment]  # a plain attribute
        module.forward = MethodType(_forward, module)  # type: ignore[method-assign]  # this instance's, on purpose
