"""The device mesh of a run: every rank is a data-parallel rank (FSDP2 shards the non-expert
weights over all of them), and the ranks are also arranged ``ep`` x ``edp``: the experts are
split over the ``ep`` ranks of a row, and each expert shard is FSDP-sharded again over the
``edp`` ranks of a column. Rank r sits at (r // edp, r % edp): the ranks of one expert-data-parallel
group are neighbours (one node on a multi-node run), the ranks of an EP group are ``edp`` apart.
Context parallel: ``cp`` consecutive ranks share one sequence (engine.parallel.context), so the
data is shared among ``world / cp`` groups; FSDP's gradient sum over all ranks needs nothing more.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engine import device as accelerator


@dataclass
class Mesh:
    dp: DeviceMesh  # all ranks, 1-D: FSDP2 of the non-expert weights
    experts: DeviceMesh  # ("ep", "edp"): expert parallel x FSDP2 of the expert shards
    device: torch.device
    context: DeviceMesh | None = None  # ("data", "cp"): consecutive ranks share a sequence

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world(self) -> int:
        return dist.get_world_size()

    @property
    def ep(self) -> int:
        return self.experts.size(0)

    @property
    def ep_rank(self) -> int:
        return self.experts.get_local_rank("ep")

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.experts.get_group("ep")

    @property
    def edp(self) -> DeviceMesh:
        return self.experts["edp"]

    @property
    def cp(self) -> int:
        return self.context.size(1) if self.context is not None else 1

    @property
    def cp_rank(self) -> int:
        return self.context.get_local_rank("cp") if self.context is not None else 0

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self.context.get_group("cp") if self.context is not None else None

    @property
    def data_rank(self) -> int:
        """This rank's place among the data-parallel groups (ranks that see different data)."""
        return self.rank // self.cp

    @property
    def data_world(self) -> int:
        return self.world // self.cp


def init_mesh(ep_size: int = 1, cp_size: int = 1) -> Mesh:
    """Join the process group torchrun describes (NCCL on CUDA, HCCL on an NPU, gloo on the CPU)
    and build the mesh. ``ep_size`` and ``cp_size`` must divide the world size."""
    device = accelerator.local_device()
    if not dist.is_initialized():
        dist.init_process_group(accelerator.dist_backend(device))
    world = dist.get_world_size()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"parallel.ep_size {ep_size} must divide the number of processes ({world})")
    if cp_size < 1 or world % cp_size:
        raise ValueError(f"parallel.cp_size {cp_size} must divide the number of processes ({world})")
    kind = device.type
    context = (
        init_device_mesh(kind, (world // cp_size, cp_size), mesh_dim_names=("data", "cp")) if cp_size > 1 else None
    )
    return Mesh(
        dp=init_device_mesh(kind, (world,), mesh_dim_names=("dp",)),
        experts=init_device_mesh(kind, (ep_size, world // ep_size), mesh_dim_names=("ep", "edp")),
        device=device,
        context=context,
    )


def close_mesh() -> NoReturn:
    """End this rank's process, its work done: leave the process group together, flush, and exit
    0 without the interpreter's finalization. A rank that tore gloo down while another still used
    its connections could abort ("terminate called without an active exception", once in 4 suite
    runs), hence the barrier; with it a rank still aborted once in 3 CI runs, after its last
    collective, 0.6 s before its peers exited. torch's own report (pytorch PR 179291) puts that
    abort in finalization, where gloo's threads drop tensors that hold Python references; so
    finalization is skipped. Everything a rank writes is closed before this call."""
    dist.barrier()
    dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
