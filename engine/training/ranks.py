"""Where a step runs: ``Single`` (one process; sharing, summing and stopping do nothing) or
``MeshRanks`` (torchrun's processes on an ``engine.parallel.mesh.Mesh``: data groups share the
examples, context-parallel ranks split each batch's sequences, counts are summed over all ranks,
rank 0's stop holds for all, the model is sharded by ``engine.parallel.fsdp.parallelize``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from engine import device as accelerator
from engine.data import collate
from engine.lora import store_frozen
from engine.spec import Reporter

if TYPE_CHECKING:
    from engine.parallel.mesh import Mesh


def share(items: list, world: int, rank: int, parts: int | None = None, size: int | None = None) -> list[list]:
    """Data group ``rank`` of ``world``'s share of ``items`` (items rank, rank + world, ...) cut
    into ``parts`` contiguous lists, or lists of ``size``. Every group gets as many lists (an
    empty one stands for nothing: collectives need every rank in every forward)."""
    mine, per = items[rank::world], math.ceil(len(items) / world)
    if not size:
        assert parts is not None  # one of parts and size is given
        size = max(1, math.ceil(per / parts))
    return [mine[i * size : (i + 1) * size] for i in range(math.ceil(per / size))]


class Single:
    """One process on the GPU if there is one, else the CPU."""

    rank0 = True

    def __init__(self, device: torch.device | None = None):
        self.device = device or accelerator.resolve()
        self.mesh: Mesh | None = None

    def share(self, items: list, parts: int | None = None, size: int | None = None) -> list[list]:
        return share(items, 1, 0, parts, size)

    def batch(self, samples: list, pad: int, pack_to: int | None) -> tuple[dict, object, int]:
        """The collated batch, no context-parallel shard, and the rows it packed."""
        batch = collate(samples, pad, pack_to)
        ids = batch["input_ids_BT"]
        assert ids is not None  # collate always gives the ids
        return batch, None, ids.shape[0]

    def sum(self, *values):
        return list(values)

    def stop(self, reporter: Reporter) -> str | None:
        return reporter.should_stop()

    def place(self, model: torch.nn.Module, full: bool, reporter: Reporter) -> None:
        if accelerator.accelerated(self.device) and not full:  # the steps run under bf16 autocast
            store_frozen(model, torch.bfloat16)  # (FSDP2 shards one dtype per group: not with a mesh)
        model.to(self.device)

    def clip(self, params: list, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def sync_routers(self, model: torch.nn.Module) -> None:
        pass

    def where(self) -> str:
        return self.device.type

    def whole(self, model: torch.nn.Module, model_dir) -> torch.nn.Module | None:
        return model


class MeshRanks(Single):
    """torchrun's ranks on a mesh; rank 0 reports."""

    mesh: Mesh

    def __init__(self, mesh: Mesh):
        super().__init__(mesh.device)
        self.mesh, self.rank0 = mesh, mesh.rank == 0

    def share(self, items: list, parts: int | None = None, size: int | None = None) -> list[list]:
        return share(items, self.mesh.data_world, self.mesh.data_rank, parts, size)

    def batch(self, samples: list, pad: int, pack_to: int | None) -> tuple[dict, object, int]:
        """Under context parallel this rank's slice of the batch and its shard; the rows packed,
        counted on one rank of a context-parallel group."""
        batch, _, rows = super().batch(samples, pad, pack_to)
        m = self.mesh
        if m.cp == 1:
            return batch, None, rows
        from engine.parallel.context import split

        return *split(batch, pad, m.cp_group, m.cp_rank, m.cp), rows if m.cp_rank == 0 else 0

    def sum(self, *values: float | torch.Tensor) -> list[float]:
        import torch.distributed as dist

        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.mesh.device)
        dist.all_reduce(t)
        return t.tolist()

    def stop(self, reporter: Reporter) -> str | None:
        import torch.distributed as dist

        box = [reporter.should_stop()]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def place(self, model: torch.nn.Module, full: bool, reporter: Reporter) -> None:
        from engine.parallel.fsdp import parallelize

        m = self.mesh
        parallelize(model, m)
        reporter.message(
            f"Parallel: {m.world} processes, FSDP2 over all, experts split {m.ep} ways"
            + (f", each sequence split {m.cp} ways (context parallel)" if m.cp > 1 else ""),
            data={"world_size": m.world, "ep_size": m.ep, "cp_size": m.cp},
        )

    def clip(self, params: list, max_norm: float) -> torch.Tensor:
        from engine.parallel.fsdp import clip_grad_norm

        return clip_grad_norm(params, max_norm)

    def sync_routers(self, model: torch.nn.Module) -> None:
        from engine.parallel.fsdp import sync_router_load

        sync_router_load(model)

    def where(self) -> str:
        return f"{self.device.type} x {self.mesh.world}"

    def whole(self, model: torch.nn.Module, model_dir) -> torch.nn.Module | None:
        """A fresh copy on rank 0 filled with the gathered weights (every rank takes part; the
        others get None)."""
        from engine.model.registry import load_base
        from engine.parallel.fsdp import full_tensors

        weights = full_tensors(model, self.mesh)
        if not self.rank0:
            return None
        whole = load_base(model_dir)
        keys = set(whole.state_dict())
        buffers = {n: b.detach().cpu() for n, b in model.named_buffers() if n in keys}
        whole.load_state_dict({**weights, **buffers}, strict=True)
        return whole


def ranks_for(mesh, device: torch.device | None = None) -> Single:
    """A mesh's ranks, or one process (on ``device``, by default the GPU if there is one)."""
    return Single(device) if mesh is None else MeshRanks(mesh)
