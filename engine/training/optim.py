"""The optimizer and its update: AdamW, fused where it can be, its step skipped on the device where
the gradient is not finite, so that a step reads nothing from the device before its update is
queued (engine.trainer, bench/e2e.py); and its state as a checkpoint gives it back."""

from __future__ import annotations

import torch


def optimizer(params: list[torch.nn.Parameter], lr: float) -> torch.optim.AdamW:
    """AdamW without weight decay, fused (one kernel over every tensor, its step skippable on the
    device: ``update``) where the parameters are all on one CPU or CUDA device."""
    devices = {p.device for p in params}
    fused = len(devices) == 1 and next(iter(devices)).type in ("cpu", "cuda")
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=fused or None)


def fused(opt: torch.optim.Optimizer) -> bool:
    return all(g.get("fused") for g in opt.param_groups)


def restored(opt: torch.optim.Optimizer) -> None:
    """After a checkpoint's optimizer state is loaded (``load_state_dict`` takes the saved groups'
    settings over the optimizer's own, DCP gives back plain step counts): the optimizer's own
    ``fused`` again, and a fused optimizer's step counts in fp32 on their parameters' devices,
    where its kernel reads them. A checkpoint written by either form resumes in either."""
    on = opt.defaults.get("fused")
    for g in opt.param_groups:
        g["fused"] = on
        for p in g["params"]:
            state = opt.state.get(p)
            if on and state and "step" in state:
                state["step"] = state["step"].to(p.device, torch.float32)


def update(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], ranks) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip the gradients to norm 1 and take the optimizer's step, unless their norm is not finite
    (seen on the H200 in bf16: a finite loss, an overflowed backward; one bad step must not poison
    the weights). Returns (norm, finite) as tensors. A fused optimizer skips the step on the device
    (its ``found_inf``, as under torch's GradScaler): nothing is read from the device before the
    update is queued, and the GPU goes from the backward into it without waiting for the host.
    Another optimizer reads ``finite`` first."""
    norm = ranks.clip(params, 1.0)
    finite = torch.isfinite(norm)
    if fused(opt):
        opt.found_inf = (~finite).float()  # type: ignore[attr-defined]
        try:
            opt.step()
        finally:  # a step taken elsewhere later skips nothing
            delattr(opt, "found_inf")
    elif finite:
        opt.step()
    return norm, finite
