"""Run by torchrun from tests/unit/test_context_parallel.py (gloo on the CPU): one training step's
forward and backward of a small Kimi Linear (or hybrid: ``--model hybrid``) model through the
trainer's own ``accumulate``, with each sequence split over ``--cp`` ranks (context parallel),
FSDP2 and expert parallel as a real run applies them; or (``--world 1``, no torchrun) the same step in one process.

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m tests.context_worker \\
        --cp 2 --ep 2 --out step.pt [--memory full]

Writes (rank 0) the step's loss, target count and the whole LoRA gradients to ``--out``.
"""

from __future__ import annotations

import argparse
import atexit
import os

import torch

from engine.config import ModelConfig
from engine.data import IGNORE, Sample
from engine.lora import apply_lora
from engine.memory import apply_swap_core
from engine.model.hybrid import HybridForCausalLM
from engine.model.kimi_linear import KimiLinearForCausalLM, init_kimi_linear, kimi_linear_tiny_config
from engine.training.ranks import ranks_for
from engine.training.step import accumulate
from kiln.spec import LoraSpec, MemorySpec

# documents crossing every slice boundary at 2 and 4 ranks, one-token ones, an empty row end
LENGTHS = [[190, 1, 57], [120, 3, 90, 35]]


def build(kind: str = "kimi") -> tuple[torch.nn.Module, list[Sample]]:
    """Kimi Linear's tiny model, or (``hybrid``) the hybrid's: 3 KDA + 1 Gated DSA (top-8 of the
    keys: a real selection), AttnRes, LatentMoE, no images."""
    torch.manual_seed(0)
    if kind == "hybrid":
        c = ModelConfig.debug(vocab_size=256)
        c.layers, c.vision = 4, None
        model: torch.nn.Module = HybridForCausalLM(c)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.1)
    else:
        kimi = KimiLinearForCausalLM(kimi_linear_tiny_config())
        init_kimi_linear(kimi, 5)
        model = kimi
    apply_lora(
        model,
        LoraSpec(
            rank=4,
            target_modules=["q_proj", "k_proj", "o_proj", "kv_b_proj", "gate_proj"]
            + (["q_b_proj"] if kind == "hybrid" else []),
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    )
    with torch.no_grad():  # B = 0 at init would leave A without a gradient
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.05)
    g = torch.Generator().manual_seed(1)
    samples: list[Sample] = []
    for row in LENGTHS:
        for n in row:
            ids = torch.randint(0, 250, (n,), generator=g)
            labels = ids.clone()
            labels[torch.rand(n, generator=g) < 0.2] = IGNORE
            samples.append(Sample(len(samples), ids, labels, torch.zeros(0, 3, 32, 32)))
    return model.train(), samples


def step(model, samples, mesh, device) -> dict:
    loss, n, right, seen, rows = accumulate(model, samples, 2, 0, 300, ranks_for(mesh, device))  # 2 micro-batches
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    if mesh is not None:
        from torch.distributed.tensor import DTensor

        from engine.parallel.fsdp import global_view

        grads = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in global_view(model, mesh, grads).items()
        }
    return {
        "loss": float(loss),
        "targets": n,
        "right": int(right),
        "seen": seen,
        "rows": rows,
        "grads": {k: v.detach().cpu() for k, v in grads.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--world", type=int, default=0, help="1: one process, no torchrun")
    p.add_argument("--memory", default="none", help="Swap Core's recompute: none, full or selective")
    p.add_argument("--model", default="kimi", choices=["kimi", "hybrid"])
    p.add_argument("--out", required=True)
    a = p.parse_args()
    model, samples = build(a.model)
    apply_swap_core(model, MemorySpec(recompute=a.memory, cache_ops=["mm", "kernels"]))
    if a.world == 1:
        torch.save(step(model, samples, None, torch.device("cpu")), a.out)
        return
    from engine.parallel.fsdp import parallelize
    from engine.parallel.mesh import close_mesh, init_mesh

    atexit.register(os.abort)  # close_mesh exits without finalization; see tests/parallel_worker.py
    mesh = init_mesh(a.ep, a.cp)
    parallelize(model, mesh)
    out = step(model, samples, mesh, mesh.device)
    if mesh.rank == 0:
        torch.save(out, a.out)
    close_mesh()


if __name__ == "__main__":
    main()
