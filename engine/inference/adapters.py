"""Many LoRA adapters on one base model, none merged: each adapter's factors sit beside the base
weights they adapt, and each forward says which rows are whose (``routes``), so requests to
different adapters of one base share its weights and one batch.

``Adapters.add`` reads a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``, the
layout engine.lora saves) and puts a ``ServedLinear`` in place of each linear layer it targets
(once: later adapters add their factors to the same layer) and a ``ServedExperts`` around each
experts module whose grouped weights it targets; a layer of a ``ServedGroup`` (``fuse``: a
server's layers that read one input, served as one product) takes its factors in its group. All
three are the identity on the base's output for rows of no adapter (the base model itself).

Each forward says which of its documents are whose (``Routing``); a served layer finds its rows'
spans by their count: the forward's tokens, or full attention's key rows (``key_layout``). A
layer that sees another number of rows (an image encoder's patches) is not served, and says so.

Legend: M rows, D in, O out, r rank, E experts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from engine.lora import PEFT_PREFIX, peft_expert_factors
from engine.model.common.moe import Experts
from kiln_kernels import widths

Route = tuple[str, int, int]


class Routing:
    """Whose rows are whose in one forward: document d of the forward belongs to ``adapters[d]``
    (None: the base). A layer sees the documents' tokens as rows (``cu``), or under full
    attention their key rows (earlier tokens too: ``keys`` adds that layout when the cache
    makes it; when all documents are fresh the two are the same)."""

    def __init__(self, adapters: list[str | None], cu: list[int]):
        self.adapters = adapters
        self.any = any(adapters)
        self.layouts = {cu[-1]: cu}
        self._spans: dict[int, list[Route]] = {}

    def keys(self, cu_k: list[int]) -> None:
        self.layouts.setdefault(cu_k[-1], cu_k)

    def spans(self, rows: int, who: str) -> list[Route]:
        """The adapters' row spans of a layer that sees ``rows`` rows, those of one adapter merged."""
        if not self.any:
            return []
        if rows in self._spans:  # every served layer of the forward asks: worked out once a layout
            return self._spans[rows]
        cu = self.layouts.get(rows)
        if cu is None:
            raise ValueError(f"{who}: {rows} rows, not the forward's tokens nor its keys ({sorted(self.layouts)})")
        out: list[Route] = []
        for a, start, end in zip(self.adapters, cu, cu[1:], strict=False):
            if a is None or start == end:
                continue
            if out and out[-1][0] == a and out[-1][2] == start:
                out[-1] = (a, out[-1][1], end)
            else:
                out.append((a, start, end))
        self._spans[rows] = out
        return out


_routing: ContextVar[Routing | None] = ContextVar("routing", default=None)


@contextmanager
def routes(routing: Routing) -> Iterator[None]:
    """For the block: the forward's rows belong to adapters as ``routing`` says."""
    token = _routing.set(routing)
    try:
        yield
    finally:
        _routing.reset(token)


def key_layout(cu_k: torch.Tensor) -> None:
    """The forward's key rows are cut into its documents by ``cu_k`` (engine.inference.cache)."""
    r = _routing.get()
    if r is not None:
        r.keys(cu_k.tolist())


def _active(rows: int, who: str) -> list[Route]:
    r = _routing.get()
    return r.spans(rows, who) if r is not None else []


class ServedLinear(nn.Module):
    """A frozen linear layer plus named LoRA factors: y = W x, and for an adapter's rows
    + scaling * B (A x). Few ops a call (a decode step calls every layer for a handful of rows,
    and its time is the host's): the rows as one matrix, a span of all rows not sliced, the
    factors kept transposed (A^T [in, r], B^T [r, out]) and the adapter's product summed into the
    base's by the GEMM (``addmm_``)."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base
        self.factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}  # name: (A^T, B^T, scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _served(x, self.base.weight, self.base.bias, self.factors, "a served linear layer")

    def effective_weight(self) -> torch.Tensor | None:
        """The layer as one matrix (a module that reads it, as DSA's absorbed attention does):
        the base's, unless an adapter of this layer is in the forward (then None: the rows
        differ, and the module calls the layer instead)."""
        r = _routing.get()
        if r is not None and any(a in self.factors for a in r.adapters if a is not None):
            return None
        return self.base.weight


def _served(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
    who: str,
) -> torch.Tensor:
    """x W^T + b, and for each adapter's rows + scaling * (x A^T) B^T (``factors``: name ->
    A^T, B^T, scaling)."""
    x2 = x.reshape(-1, x.shape[-1])
    y2 = F.linear(x2, weight, bias)
    rows = x2.shape[0]
    for name, a, b in _active(rows, who):
        f = factors.get(name)
        if f is None:
            continue
        At, Bt, s = f
        xs, ys = (x2, y2) if (a, b) == (0, rows) else (x2[a:b], y2[a:b])
        ys.addmm_(torch.mm(widths.cast(xs, At.dtype), At), Bt, alpha=s)
    return y2.view(*x.shape[:-1], y2.shape[-1])


class ServedGroup(nn.Module):
    """Linear layers that read one input (a module's ``input_projections``: KDA's six, an MLP's
    gate and up), served as one: their weights become views of the rows of one matrix (no copy
    kept), one product serves them all, and an adapter's factors on any of them sit side by side,
    its A's stacked ([in, sum of ranks]) and its B's block-diagonal ([sum of ranks, out]): one
    product pair an adapter. A decode step's time is the host's per op: KDA's six projections
    with one adapter on three took fifteen ops, here three. The module calls it in their place
    (``served_group``), which gives the layers' outputs in order, views of one tensor (KDA takes
    what it needs of it before its delta rule, so that a long prefill frees it there). The
    matrix is a buffer (not saved): a cast or move of the model takes it along, but then the
    layers' weights become copies of their own and the adapters' factors stay as they were: fuse
    and add adapters where the model serves."""

    weight: torch.Tensor

    def __init__(self, layers: list[nn.Linear]):
        super().__init__()
        self.register_buffer("weight", torch.cat([m.weight.detach() for m in layers]), persistent=False)
        self.sizes = [m.out_features for m in layers]
        for m, w in zip(layers, self.weight.split(self.sizes), strict=True):
            m.weight = nn.Parameter(w, requires_grad=m.weight.requires_grad)
        self.parts: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # adapter: layer -> A^T, B^T
        self.factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}  # adapter: A^Ts, B^Ts, scaling

    def add(self, name: str, i: int, At: torch.Tensor, Bt: torch.Tensor, scaling: float) -> None:
        """Adapter ``name``'s factors (transposed) on the group's ``i``-th layer."""
        parts = self.parts.setdefault(name, {})
        parts[i] = At, Bt
        ranks = [parts[j][0].shape[1] for j in sorted(parts)]
        B = Bt.new_zeros(sum(ranks), self.weight.shape[0])
        row = 0
        for j, r in zip(sorted(parts), ranks, strict=True):
            col = sum(self.sizes[:j])
            B[row : row + r, col : col + self.sizes[j]] = parts[j][1]
            row += r
        self.factors[name] = torch.cat([parts[j][0] for j in sorted(parts)], 1), B, scaling

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(_served(x, self.weight, None, self.factors, "a served group of layers").split(self.sizes, -1))


def fuse(model: nn.Module) -> None:
    """Serve each module's ``input_projections`` as one ``ServedGroup`` where they are plain
    linear layers without bias of one input width, dtype and device (a server's model, once it
    sits where it serves; adapters added later find the group)."""
    for m in list(model.modules()):
        names = getattr(m, "input_projections", None)
        if names is None or getattr(m, "served_group", None) is not None:
            continue
        layers = cast(list[nn.Linear], [m.get_submodule(n) for n in names()])
        plain = all(type(x) is nn.Linear and x.bias is None for x in layers)  # not a LoRA layer, not served
        if plain and len({(x.in_features, x.weight.dtype, x.weight.device) for x in layers}) == 1:
            m.served_group = ServedGroup(layers)


def _groups(model: nn.Module) -> dict[str, tuple[ServedGroup, int]]:
    """Each grouped layer's path: its group and its place in it."""
    out = {}
    for path, m in model.named_modules():
        group = getattr(m, "served_group", None)
        if isinstance(group, ServedGroup):
            for i, n in enumerate(m.input_projections()):
                out[f"{path}.{n}" if path else n] = group, i
    return out


class _Factors:
    """What ``Experts.grouped`` reads of an adapter: ``factors()`` and ``scaling``."""

    def __init__(self, factors: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float):
        self._f, self.scaling = factors, scaling

    def factors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return self._f


class ServedExperts(nn.Module):
    """An experts module whose adapters' rows run through it apart, each with its factors."""

    def __init__(self, experts: Experts):
        super().__init__()
        self.inner = experts
        self.factors: dict[str, _Factors] = {}

    def forward(self, x_ND: torch.Tensor, idx_NK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        N = x_ND.shape[0]
        spans = [r for r in _active(N, "a served experts module") if r[0] in self.factors]
        if not spans:
            return self.inner(x_ND, idx_NK, w_NK)
        if len(spans) == 1 and spans[0][1:] == (0, N):  # every row one adapter's: no slices, no cat
            return self._adapted(spans[0][0], x_ND, idx_NK, w_NK)
        pieces, at = [], 0  # the base's rows between the adapters' spans, each span with its factors
        for name, a, b in [*spans, ("", N, N)]:
            if at < a:
                pieces.append(self.inner(x_ND[at:a], idx_NK[at:a], w_NK[at:a]))
            if name:
                pieces.append(self._adapted(name, x_ND[a:b], idx_NK[a:b], w_NK[a:b]))
            at = b
        return torch.cat(pieces)

    def _adapted(self, name: str, x_ND: torch.Tensor, idx_NK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        setattr(self.inner, "lora", self.factors[name])  # noqa: B010  (what Experts.grouped reads)
        try:
            return self.inner(x_ND, idx_NK, w_NK)
        finally:
            delattr(self.inner, "lora")


class Adapters:
    """The adapters served on ``model`` (a base model, its weights never changed)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.names: set[str] = set()

    def add(self, name: str, folder: Path) -> None:
        """Serve the PEFT adapter in ``folder`` as ``name`` (again: nothing to do)."""
        if name in self.names:
            return
        config = json.loads((Path(folder) / "adapter_config.json").read_text())
        state = load_file(str(Path(folder) / "adapter_model.safetensors"))
        scaling = float(config["lora_alpha"]) / float(config["r"])
        device = next(self.model.parameters()).device
        names = [t.rsplit(".", 1)[-1] for t in config.get("target_parameters") or []]
        modules = dict(self.model.named_modules())
        linears: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        experts: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        if names:
            for path, m in modules.items():
                inner = m.inner if isinstance(m, ServedExperts) else m
                if path.endswith("mlp.experts") and isinstance(inner, Experts):
                    E = inner.gate_up_proj.shape[0]
                    experts[path] = peft_expert_factors(state, path, names, E)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in state.items():
            path, part = key.removeprefix(PEFT_PREFIX).rsplit(".", 2)[:2]
            if part not in ("lora_A", "lora_B"):
                raise ValueError(f"adapter {name}: key {key} is not a LoRA factor")
            pairs.setdefault(path, {})[part] = t
        for path, p in pairs.items():
            m = modules.get(path)
            base = m.base if isinstance(m, ServedLinear) else m
            if not isinstance(base, nn.Linear) or set(p) != {"lora_A", "lora_B"}:
                raise ValueError(f"adapter {name}: {path} is not a linear layer of the base model")
            A, B = p["lora_A"], p["lora_B"]
            if A.shape[1] != base.in_features or B.shape[0] != base.out_features:
                raise ValueError(f"adapter {name}: {path}'s factors do not fit the base model's layer")
            linears[path] = A, B
        # every check passed: only now does the model change; the factors in their layer's dtype

        def put(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:  # (PEFT's expert layout: a permuted view)
            return t.to(device, like.dtype).contiguous()

        groups = _groups(self.model)
        for path, (A, B) in linears.items():
            if path in groups:
                group, i = groups[path]
                group.add(name, i, put(A.t(), group.weight), put(B.t(), group.weight), scaling)
                continue
            layer = self._served(path, ServedLinear)
            W = layer.base.weight
            layer.factors[name] = (put(A.t(), W), put(B.t(), W), scaling)
        for path, f in experts.items():
            served = self._served(path, ServedExperts)
            W = served.inner.gate_up_proj
            served.factors[name] = _Factors({k: (put(A, W), put(B, W)) for k, (A, B) in f.items()}, scaling)
        self.names.add(name)

    def _served(self, path: str, kind):
        parent_path, _, child = path.rpartition(".")
        parent = self.model.get_submodule(parent_path)
        m = getattr(parent, child)
        if not isinstance(m, kind):
            m = kind(m)
            setattr(parent, child, m)
        return m

    def remove(self, name: str) -> None:
        for m in self.model.modules():
            if isinstance(m, (ServedLinear, ServedExperts, ServedGroup)):
                m.factors.pop(name, None)
            if isinstance(m, ServedGroup):
                m.parts.pop(name, None)
        self.names.discard(name)
