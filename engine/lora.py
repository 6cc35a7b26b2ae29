"""LoRA on linear layers: y = W x + (alpha / r) * B(A(dropout(x))), W frozen and never copied;
and on grouped expert weights, per expert: y_e = W_e x + (alpha / r) * B_e (A_e x), computed from
the factors (never W_e + B_e A_e, which for a K3 layer would be ~39 GB each forward).

Saved in PEFT's layout: ``adapter_config.json`` and ``adapter_model.safetensors`` with keys
``base_model.model.<module path>.lora_A.weight`` ([r, in]) and ``.lora_B.weight`` ([out, r]).
Expert LoRA follows PEFT's ``target_parameters``: ``lora_A`` is [E*r, in] (expert-major),
``lora_B`` is [out, r*E] (rank-major); the first target parameter of a module is nested under
``base_layer``, as PEFT nests its wrappers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import overload

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from kiln.spec import LoraSpec
from kiln_kernels.dispatch import kept

PEFT_PREFIX = "base_model.model."


def frozen_linear(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, b)`` for a frozen W and b, cast as autocast casts it: the same product and
    the same dx = dy W, through one autograd Function. It saves no activation, and its product goes
    through ``kiln_kernels.dispatch.kept`` as "projection": Swap Core can keep it (``cache_ops:
    projections``) with no dispatch mode, and the recompute then skips the matmul."""
    dt = _autocast_dtype(x)
    x, W, b = _cast(x, dt), _cast(W, dt), _cast(b, dt)
    with torch.autocast(x.device.type, enabled=False):
        return _FrozenLinear.apply(x, W, b)


class _FrozenLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(W)
        return kept("projection", lambda: F.linear(x, W, b))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (W,) = ctx.saved_tensors  # as aten's mm backward: [N, out] x [out, in], then the input's shape
        return dy.reshape(-1, dy.shape[-1]).mm(W).view(*dy.shape[:-1], W.shape[1]), None, None


def lora_linear(
    x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, A: torch.Tensor, B: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``F.linear(x, W, b) + F.linear(F.linear(x, A) * scaling, B)`` for a frozen W and b, cast as
    autocast casts it, as one autograd Function. The adapter's product is summed into the base's by
    the GEMM itself (``addmm_``, one rounding, no separate add), forward and for dx; the factors'
    gradients are autograd's own products, in their dtype. The whole output (and A x) goes through
    ``kiln_kernels.dispatch.kept`` as "projection": kept, the recompute skips the base product, both
    factor products and the scaling, and casts x once for the backward."""
    dt = _autocast_dtype(x)
    W, b = _cast(W, dt), _cast(b, dt)
    with torch.autocast(x.device.type, enabled=False):
        return _LoRAProduct.apply(x, W, b, A, B, scaling, dt)


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast casts matmul inputs on x's device to; None where autocast is off."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


@overload
def _cast(t: torch.Tensor, dt: torch.dtype | None) -> torch.Tensor: ...
@overload
def _cast(t: None, dt: torch.dtype | None) -> None: ...
@overload
def _cast(t: torch.Tensor | None, dt: torch.dtype | None) -> torch.Tensor | None: ...


def _cast(t: torch.Tensor | None, dt: torch.dtype | None) -> torch.Tensor | None:
    """As autocast casts an input of a matmul to ``dt`` (None: autocast is off)."""
    if t is None or dt is None or t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return t
    return t.to(dt)


class _LoRAProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, W, b, A, B, s: float, dt):
        xc, Ac, Bc = _cast(x, dt), _cast(A, dt), _cast(B, dt)

        def run():
            t = F.linear(xc, Ac) * s
            y = F.linear(xc, W, b)  # out of place: Swap Core may keep this product ("mm")
            n = y.shape[-1]
            return torch.addmm(y.view(-1, n), t.view(-1, t.shape[-1]), Bc.t()).view(y.shape), t

        out, t = kept("projection", run)
        ctx.save_for_backward(xc, W, Ac, Bc, t)
        ctx.s, ctx.dtypes = s, (x.dtype, A.dtype, B.dtype)
        return out

    @staticmethod
    def backward(ctx, dy):
        with torch.autocast(dy.device.type, enabled=False):  # the forward's dtypes, whatever the caller's autocast
            return _LoRAProduct._grads(ctx, dy)

    @staticmethod
    def _grads(ctx, dy):
        xc, W, Ac, Bc, t = ctx.saved_tensors
        x_dt, A_dt, B_dt = ctx.dtypes
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), xc.reshape(-1, xc.shape[-1])
        dB = dy2.t().mm(t.reshape(-1, t.shape[-1]))  # aten's mm backward for a row-major weight
        dts = dy2.mm(Bc) * ctx.s
        dA = dts.t().mm(x2)
        dx = None
        if ctx.needs_input_grad[0]:  # both paths back in one GEMM's sum, then in x's dtype
            dx = dy2.mm(W).addmm_(dts, Ac).to(x_dt).view(*dy.shape[:-1], W.shape[1])
        return dx, None, None, dA.to(A_dt), dB.to(B_dt), None, None


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base = base
        base.weight.requires_grad_(False)
        if base.bias is not None:
            base.bias.requires_grad_(False)
        dev, dt = base.weight.device, torch.promote_types(base.weight.dtype, torch.float32)  # factors >= fp32
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=dev, dtype=dt)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=dev, dtype=dt)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default init
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        W, b, A = self.base.weight, self.base.bias, self.lora_A.weight
        frozen = not (W.requires_grad or b is not None and b.requires_grad)
        if (
            frozen
            and not self.merged
            and isinstance(self.dropout, nn.Identity)  # (dropout draws: not kept)
            and (torch.is_autocast_enabled(x.device.type) or x.dtype == W.dtype == A.dtype)
        ):
            return lora_linear(x, W, b, A, self.lora_B.weight, self.scaling)
        y = frozen_linear(x, W, b) if frozen else self.base(x)
        if self.merged:
            return y
        # scaled at rank r, not at the output's width (a power-of-two scaling gives the same bits)
        low = self.lora_B(self.lora_A(self.dropout(x).to(self.lora_A.weight.dtype)) * self.scaling)
        return y + low.to(y.dtype)  # the base layer's dtype: bf16 under autocast, even for fp32
        # inputs (an fp32 sum here sent the attention kernels fp32, 10x slower, on the H200)

    merged = False

    def effective_weight(self) -> torch.Tensor | None:
        """The layer as one matrix, W + (B A) * scaling in W's dtype, with autograd to the factors: for
        a module that reads its sublayer's weight instead of calling it (DSA's absorbed
        ``kv_b_proj``). None where dropout makes the layer more than one matrix (training, not merged)."""
        if self.training and isinstance(self.dropout, nn.Dropout) and not self.merged:
            return None
        W = self.base.weight
        if not self.merged:
            W = W + (self.lora_B.weight @ self.lora_A.weight * self.scaling).to(W.dtype)
        return W

    @torch.no_grad()
    def merge(self, sign: float = 1.0) -> None:
        """Fold B A into the base weight in place (sign -1 takes it out again)."""
        self.base.weight += sign * (self.lora_B.weight @ self.lora_A.weight).to(self.base.weight.dtype) * self.scaling
        self.merged = sign > 0


class ExpertsLoRA(nn.Module):
    """LoRA factors for an experts module's grouped projections (``gate_up_proj`` [E, 2I, D],
    ``down_proj`` [E, D, I]), used by the module's forward through ``factors``."""

    def __init__(self, experts: nn.Module, names: list[str], rank: int, alpha: float):
        super().__init__()
        self.names, self.scaling = names, alpha / rank
        for name in names:
            W = getattr(experts, name)
            E, out, inp = W.shape
            dev, dt = W.device, torch.promote_types(W.dtype, torch.float32)
            A = torch.empty(E, rank, inp, device=dev, dtype=dt)
            for e in range(E):
                nn.init.kaiming_uniform_(A[e], a=math.sqrt(5))
            self.register_parameter(f"{name}_A", nn.Parameter(A))
            self.register_parameter(f"{name}_B", nn.Parameter(torch.zeros(E, out, rank, device=dev, dtype=dt)))

    merged = False

    def factors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        """{projection: (A [E, r, in], B [E, out, r])} for kiln_kernels.moe; None while merged."""
        if self.merged:
            return None
        return {name: (getattr(self, f"{name}_A"), getattr(self, f"{name}_B")) for name in self.names}


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model, for as long as the block runs: every adapter acts as if merged into
    weights that were never changed (DPO's reference model, with no second copy of the weights)."""
    off = [m for m in model.modules() if isinstance(m, (LoRALinear, ExpertsLoRA)) and not m.merged]
    for m in off:
        m.merged = True
    try:
        yield
    finally:
        for m in off:
            del m.merged  # the class's False again


@torch.no_grad()
def merge(model: nn.Module, sign: float = 1.0) -> None:
    """Fold every adapter into its base weights in place, for inference without the LoRA path;
    ``unmerge`` takes them out again. The base tensors are updated, never copied."""
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear) and m.merged != (sign > 0):
            m.merge(sign)
        elif isinstance(m, ExpertsLoRA) and m.merged != (sign > 0):
            experts = model.get_submodule(name.removesuffix(".lora"))
            for p in m.names:
                A, B = getattr(m, f"{p}_A"), getattr(m, f"{p}_B")
                getattr(experts, p).data += sign * torch.bmm(B, A).to(getattr(experts, p).dtype) * m.scaling
            m.merged = sign > 0


def unmerge(model: nn.Module) -> None:
    merge(model, -1.0)


def apply_lora(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Freeze the model and wrap every nn.Linear whose last name is a target, and put expert
    LoRA on every experts module named by ``target_parameters``. Returns the wrapped paths."""
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    expert_names = [t.rsplit(".", 1)[-1] for t in spec.target_parameters]
    if expert_names:
        for name, module in model.named_modules():
            if name.endswith("mlp.experts") and all(hasattr(module, n) for n in expert_names):
                module.lora = ExpertsLoRA(module, expert_names, spec.rank, spec.alpha)
                wrapped.append(name)
        if not wrapped:
            raise ValueError(f"lora.target_parameters: the model has no experts with {', '.join(expert_names)}")
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in spec.target_modules and isinstance(child, nn.Linear):
                setattr(module, child_name, LoRALinear(child, spec.rank, spec.alpha, spec.dropout))
                wrapped.append(f"{name}.{child_name}" if name else child_name)
    missing = set(spec.target_modules) - {w.rsplit(".", 1)[-1] for w in wrapped if not w.endswith("mlp.experts")}
    if missing:
        raise ValueError(f"lora.target_modules: the model has no linear layer named {', '.join(sorted(missing))}")
    return wrapped


@torch.no_grad()
def store_frozen(model: nn.Module, dtype: torch.dtype) -> int:
    """Store the frozen weights that only enter matmuls under autocast (``nn.Linear`` and
    ``nn.Conv1d`` weights and biases, the experts' grouped weights) in autocast's ``dtype``; returns
    the bytes saved. Autocast casts a weight at every use unless it requires grad (only those are
    cached): a frozen fp32 base is cast in every forward, again in every recompute, and kept in
    twice the memory. The products are the same: the stored weight is what the cast gave. Not for
    ``merge`` (folding B A into a bf16 weight and out again loses bits). A module's
    ``weights_read`` names sublayers whose weights it reads as matrices: those stay as they are."""
    saved = 0
    read = {
        id(t) for m in model.modules() for name in getattr(m, "weights_read", ()) for t in getattr(m, name).parameters()
    }
    for mname, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv1d)):
            params = [m.weight, m.bias]
        elif mname.endswith("mlp.experts"):
            params = [getattr(m, n, None) for n in ("gate_up_proj", "down_proj")]
        else:
            continue
        for t in params:
            if (
                isinstance(t, nn.Parameter)
                and not t.requires_grad
                and t.is_floating_point()
                and t.dtype != dtype
                and id(t) not in read
            ):
                saved += t.numel() * (t.element_size() - torch.finfo(dtype).bits // 8)
                t.data = t.data.to(dtype)
    return saved


def _expert_keys(experts_path: str, names: list[str], i: int) -> str:
    """PEFT nests one wrapper per target parameter: the first is innermost (``base_layer``)."""
    return f"{PEFT_PREFIX}{experts_path}" + ".base_layer" * (len(names) - 1 - i)


def lora_state(model: nn.Module, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter tensors under PEFT's key names. ``tensors``: the factors by parameter name, when
    the module's own are shards (a parallel run gathers them first)."""
    own = dict(model.named_parameters())

    def get(name: str) -> torch.Tensor:
        return (tensors[name] if tensors is not None else own[name]).detach()

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = get(f"{name}.lora_A.weight").contiguous().cpu()
            out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = get(f"{name}.lora_B.weight").contiguous().cpu()
        elif isinstance(module, ExpertsLoRA):
            path = name.removesuffix(".lora")
            for i, p in enumerate(module.names):
                A, B = get(f"{name}.{p}_A"), get(f"{name}.{p}_B")
                E, r, inp = A.shape
                key = _expert_keys(path, module.names, i)
                out[f"{key}.lora_A.weight"] = A.reshape(E * r, inp).contiguous().cpu()
                out[f"{key}.lora_B.weight"] = B.permute(1, 2, 0).reshape(B.shape[1], r * E).contiguous().cpu()
    return out


def peft_expert_factors(
    state: dict[str, torch.Tensor], experts_path: str, names: list[str], experts: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """An experts module's factors out of PEFT's layout, popped from ``state``: {projection:
    (A [E, r, in], B [E, out, r])}, ``names`` in the adapter's ``target_parameters`` order."""
    out = {}
    for i, p in enumerate(names):
        key = _expert_keys(experts_path, names, i)
        A, B = state.pop(f"{key}.lora_A.weight"), state.pop(f"{key}.lora_B.weight")
        r = A.shape[0] // experts
        out[p] = A.reshape(experts, r, A.shape[1]), B.reshape(B.shape[0], r, experts).permute(2, 0, 1)
    return out


def load_lora_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    modules = dict(model.named_modules())
    seen = set()
    state = dict(state)
    for name, module in modules.items():  # expert factors first, back from PEFT's layout
        if isinstance(module, ExpertsLoRA):
            E = getattr(module, f"{module.names[0]}_A").shape[0]
            for p, (A, B) in peft_expert_factors(state, name.removesuffix(".lora"), module.names, E).items():
                getattr(module, f"{p}_A").data.copy_(A)
                getattr(module, f"{p}_B").data.copy_(B)
    for key, tensor in state.items():
        path, part = key.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0], key.rsplit(".", 2)[1]
        module = modules.get(path)
        if not isinstance(module, LoRALinear):
            raise ValueError(f"adapter key {key} matches no LoRA layer of the model")
        getattr(module, part).weight.data.copy_(tensor)
        seen.add(path)
    expected = {n for n, m in modules.items() if isinstance(m, LoRALinear)}
    if seen != expected:
        raise ValueError(f"adapter lacks {sorted(expected - seen)[:5]}")


def save_adapter(
    model: nn.Module, spec: LoraSpec, base_model: str, folder: Path, tensors: dict[str, torch.Tensor] | None = None
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(lora_state(model, tensors), str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(spec.target_modules),
        "target_parameters": list(spec.target_parameters) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
        "layers_pattern": None,
        "revision": None,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))


def load_adapter(model: nn.Module, folder: Path) -> None:
    load_lora_state(model, load_file(str(folder / "adapter_model.safetensors")))
