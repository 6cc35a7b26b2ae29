"""Run by torchrun from tests/unit/test_parallel.py (gloo on the CPU): one forward and backward
of a small hybrid model, parallelized (FSDP2 + expert parallel), or a DCP save / load.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.parallel_worker \
        --mode lora --ep 2 --out grads.pt [--save DIR | --load DIR]

Rank 0 writes the loss and the whole (gathered) gradients or parameters to ``--out``.
``build`` and ``step_loss`` are shared with the single-process reference in the test.
"""

from __future__ import annotations

import argparse
import atexit
import os

import torch

from engine.config import ModelConfig
from engine.lora import apply_lora
from engine.model.hybrid import HybridForCausalLM
from engine.training.step import batch_loss
from kiln.spec import LoraSpec

ROWS, T = 4, 24


def build(mode: str, seed: int = 0) -> tuple[HybridForCausalLM, dict]:
    c = ModelConfig.debug()
    c.layers, c.vision = 4, None
    c.moe.experts, c.moe.top_k = 8, 3
    torch.manual_seed(seed)
    model = HybridForCausalLM(c)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.1)
    if mode == "lora":
        apply_lora(
            model,
            LoraSpec(
                rank=4,
                target_modules=["q_proj", "o_proj", "gate_proj", "down_proj"],
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            ),
        )
        with torch.no_grad():  # B = 0 at init would leave A without a gradient
            for p in model.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn_like(p) * 0.1)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, c.vocab_size, (ROWS, T), generator=g)
    labels = ids.clone()
    labels[torch.rand(ROWS, T, generator=g) < 0.3] = -100
    return model.train(), {"ids": ids, "labels": labels}


def step_loss(model, data: dict, rows: list[int], n_total: int, device: torch.device) -> torch.Tensor:
    """One rank's share of the step's loss: the summed cross-entropy of its rows over the
    whole step's target count, and the DSA indexers' loss weighted by the rows' share of targets."""
    batch = {
        "input_ids_BT": data["ids"][rows],
        "labels_BT": data["labels"][rows],
        "doc_ids_BT": None,
        "positions_BT": None,
        "pixels_NCHW": torch.zeros(0),
    }
    loss, n, _ = batch_loss(model, batch, device)
    extra = model.indexer_loss()  # None where no indexer learns (LoRA leaves them out)
    return (loss + extra if extra is not None else loss) * (n / n_total)


def n_targets(data: dict) -> int:
    return int((data["labels"][:, 1:] != -100).sum())


def state(model, mesh, opt) -> dict:
    """The whole parameters, and AdamW's first moments (collective)."""
    from torch.distributed.tensor import DTensor

    from engine.parallel.fsdp import full_tensors, global_view

    moments = {n: opt.state[q]["exp_avg"] for n, q in model.named_parameters() if q in opt.state}
    return {
        "params": full_tensors(model, mesh),
        "exp_avg": {
            n: (t.full_tensor() if isinstance(t, DTensor) else t).cpu()
            for n, t in global_view(model, mesh, moments).items()
        },
    }


def main() -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from engine.checkpoint import dcp
    from engine.parallel.fsdp import full_tensors, global_view, parallelize
    from engine.parallel.mesh import close_mesh, init_mesh

    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="lora")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--out", required=True)
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--meta", help="with --load: a model folder; build its model on the meta device, shard, load")
    a = p.parse_args()
    # A rank's exit code must not depend on the interpreter's finalization (where gloo can abort):
    # close_mesh skips it, so this handler never runs (torchrun would report -6 if it did).
    atexit.register(os.abort)
    if os.environ.get("KILN_DETERMINISTIC"):  # GPU comparisons: no atomics, so no routing flips between runs
        torch.use_deterministic_algorithms(True)
    mesh = init_mesh(a.ep)
    if a.meta:  # the sharded load of a big model: meta init, shard, to_empty, read only the local pieces
        from pathlib import Path

        from engine.model.registry import build_meta

        model = parallelize(build_meta(Path(a.meta)), mesh).to_empty(device=mesh.device)
        dcp.load(a.load, model, mesh, everything=True)
        loaded = {"params": full_tensors(model, mesh), "buffers": {n: b.cpu() for n, b in model.named_buffers()}}
        if mesh.rank == 0:
            torch.save(loaded, a.out)
        close_mesh()
    model, data = build(a.mode, seed=1 if a.load else 0)  # a load must overwrite another init
    parallelize(model, mesh)
    trainable = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    if a.load:  # write what was read, nothing else
        dcp.load(a.load, model, mesh, opt, everything=True)
        read = state(model, mesh, opt)
        if mesh.rank == 0:
            torch.save(read, a.out)
        close_mesh()
    rows = list(range(mesh.rank, ROWS, mesh.world))
    loss = step_loss(model, data, rows, n_targets(data), mesh.device)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    local = {n: q.grad for n, q in model.named_parameters() if q.grad is not None and q.requires_grad}
    grads = {
        n: (g.full_tensor() if isinstance(g, DTensor) else g).cpu() for n, g in global_view(model, mesh, local).items()
    }
    opt.step()
    out: dict[str, object] = {"loss": float(total), "grads": grads, **state(model, mesh, opt)}
    if a.save:
        dcp.save(a.save, model, mesh, opt, everything=True)
    if mesh.rank == 0:
        torch.save(out, a.out)
    close_mesh()


if __name__ == "__main__":
    main()
