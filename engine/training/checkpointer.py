"""Exact resume: a checkpoint holds what the objective trains, the optimizer and scheduler
state, the step, the tokens and the RNG state (the batches of an epoch depend only on the seed
and the epoch, so a resumed run makes the steps the uninterrupted one would have). Two formats
behind one interface: ``SingleFile`` (one process: the objective's files and trainer_state.pt)
and ``Sharded`` (a mesh: every rank's shards of the trained weights and of AdamW's state in
``dcp/``, loadable on any world size; rank 0 the adapter gathered in PEFT's layout). ``resume``
reads either."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from engine import device as accelerator
from engine.spec import Store
from engine.training.optim import restored


def trainer_state(step: int, tokens: int, sched, opt=None) -> dict:
    return {
        "step": step,
        "tokens": tokens,
        "scheduler": sched.state_dict(),
        **({"optimizer": opt.state_dict()} if opt is not None else {}),
        "rng": torch.get_rng_state(),  # dropout on an accelerator draws from its own generators
        "device_rng": accelerator.rng_state(),
    }


class SingleFile:
    def __init__(self, store: Store, objective, ranks):
        self.store, self.objective, self.ranks = store, objective, ranks

    def save(self, key: str, model, opt, sched, step: int, tokens: int) -> None:
        with self.store.publish_dir(key) as folder:
            self.objective.save(model, folder)
            torch.save(trainer_state(step, tokens, sched, opt), folder / "trainer_state.pt")

    def resume(self, key: str, model, opt, sched) -> tuple[int, int]:
        """Load a checkpoint of either format into the model, the optimizer and the scheduler.
        Returns (step, tokens)."""
        folder = self.store.path(key)
        state = torch.load(folder / "trainer_state.pt", weights_only=False)
        mesh = self.ranks.mesh
        if (folder / "dcp").exists():
            from engine.checkpoint import dcp

            dcp.load(folder / "dcp", model, mesh, opt, everything=self.objective.full)
            for g, lr in zip(opt.param_groups, state["lr"], strict=True):
                g["lr"] = lr
            rng = folder / f"rng-{mesh.rank if mesh is not None else 0}.pt"
            torch.set_rng_state(torch.load(rng)["rng"] if rng.exists() else state["rng"])
        elif mesh is not None:
            raise ValueError(f"{key} was written by a single process; resume it with parallel.nproc 1")
        else:
            self.objective.load(model, folder)
            opt.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"])
        restored(opt)  # the optimizer's own form, whichever wrote the checkpoint
        sched.load_state_dict(state["scheduler"])
        if mesh is None:  # (a checkpoint from before the device layer named CUDA's alone)
            old = state.get("cuda_rng")
            accelerator.set_rng_state(state.get("device_rng") or ({"kind": "cuda", "states": old} if old else None))
        return state["step"], state["tokens"]


class Sharded(SingleFile):
    def save(self, key: str, model, opt, sched, step: int, tokens: int) -> None:
        """Every rank writes its shards into ``dcp/`` and its RNG state; rank 0 the adapter
        (gathered), the scheduler and its RNG state, then publishes the folder."""
        import torch.distributed as dist

        from engine.checkpoint import dcp
        from engine.parallel.fsdp import full_tensors

        mesh, full = self.ranks.mesh, self.objective.full
        with self.store.publish_dir(key) if mesh.rank == 0 else _nothing() as folder:
            box = [str(folder) if folder else None]
            dist.broadcast_object_list(box, src=0)
            assert box[0] is not None  # rank 0 published the folder
            folder = Path(box[0])
            dcp.save(folder / "dcp", model, mesh, opt, everything=full)
            gathered = full_tensors(model, mesh, self.objective.trained_names(model)) if not full else None
            torch.save({"rng": torch.get_rng_state()}, folder / f"rng-{mesh.rank}.pt")
            if mesh.rank == 0:
                if not full:
                    self.objective.save(model, folder, gathered)
                torch.save(
                    {**trainer_state(step, tokens, sched), "lr": [g["lr"] for g in opt.param_groups]},
                    folder / "trainer_state.pt",
                )
            dist.barrier()  # every shard is on disk before rank 0 publishes the folder


@contextmanager
def _nothing():
    yield None


def checkpointer_for(store: Store, objective, ranks) -> SingleFile:
    return SingleFile(store, objective, ranks) if ranks.mesh is None else Sharded(store, objective, ranks)
