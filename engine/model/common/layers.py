"""Small layers every model here uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kiln_kernels.kda import Gate
from kiln_kernels.norm import gated_rms_norm, rms_norm
from kiln_kernels.widths import wide


def f32(x: torch.Tensor) -> torch.Tensor:
    """At least fp32: fp64 stays fp64 (the checks run the model in fp64)."""
    return wide(x)


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """x in autocast's dtype when autocast is on, else as it is: one cast for all the projections
    that read x (autocast casts an activation again at each linear: bench/RESULTS.md, the
    fourteenth session's whole-step section). The same values either way: autocast casts
    floating tensors other than float64."""
    dev = x.device.type
    if not torch.is_autocast_enabled(dev) or x.dtype in (torch.float64, torch.get_autocast_dtype(dev)):
        return x  # autocast leaves float64 alone (the checks run the model in float64)
    return x.to(torch.get_autocast_dtype(dev))


def absorbed_kv_b(
    layer: nn.Module, H: int, nope: int, v: int, rank: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """MLA's ``kv_b_proj`` (LoRA included) as W_UK [H, nope, rank] and W_UV [H, v, rank], for the
    absorbed form (the queries taken into the latent space, the latent the keys and values of every
    head); (None, None) where the layer is more than one matrix (LoRA dropout while training, or a
    served adapter's rows in the forward). A layer that wraps the linear one says what matrix it is
    by ``effective_weight`` (engine.lora.LoRALinear, engine.inference.adapters.ServedLinear)."""
    effective = getattr(layer, "effective_weight", None)
    W: torch.Tensor | None = effective() if callable(effective) else layer.get_parameter("weight")
    if W is None:
        return None, None
    W = W.view(H, nope + v, rank)
    return W[:, :nope], W[:, nope:]


class RMSNorm(nn.Module):
    """kiln_kernels.norm.rms_norm: in fp32, the result in the wider of the weight's and x's dtypes."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def for_matmuls(self, x: torch.Tensor) -> torch.Tensor:
        """The norm for a block whose every reader of it is a matmul: in autocast's dtype where
        autocast is on, written so by the norm (what ``autocast_input`` would make of the wide
        result, without the wide copy and its cast, each way)."""
        dev = x.device.type
        wide = torch.promote_types(x.dtype, self.weight.dtype)
        on = torch.is_autocast_enabled(dev) and wide != torch.float64
        return rms_norm(x, self.weight, self.eps, torch.get_autocast_dtype(dev) if on else None)


class GatedRMSNorm(RMSNorm):
    """kiln_kernels.norm.gated_rms_norm: the norm times sigmoid(gate), in x's dtype."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]  # the gate too
        return gated_rms_norm(x, gate, self.weight, self.eps)


def doc_starts(doc_ids_BT: torch.Tensor | None, B: int, T: int, device: torch.device) -> torch.Tensor:
    """The first key each query sees [B, T]: 0, or with ``doc_ids_BT`` (contiguous documents in
    packed rows) the first token of the query's document."""
    if doc_ids_BT is None:
        return torch.zeros(B, T, dtype=torch.long, device=device)
    t = torch.arange(T, device=device).expand(B, T)
    new = torch.ones(B, T, dtype=torch.bool, device=device)
    new[:, 1:] = doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1]
    return torch.cummax(torch.where(new, t, 0), 1).values


def rows_end_to_end(doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """Packed rows laid end to end as one sequence [1, B*T], document ids made distinct across
    rows and each row's padding (-1) its own document: for layers with state across tokens."""
    B, T = doc_ids_BT.shape
    row = torch.arange(B, device=doc_ids_BT.device)[:, None] * (T + 1)
    return (torch.where(doc_ids_BT >= 0, doc_ids_BT, T) + row).reshape(1, B * T)


def cu_seqlens(doc_ids_1T: torch.Tensor) -> torch.Tensor:
    """Where each document starts in one packed row, and its end: [N + 1], in host memory. The row's
    ids come over once a forward (one host sync); the KDA kernel cuts its chunks from the offsets
    on the host at every call and every recompute, and would otherwise read them back each time."""
    d = doc_ids_1T[0].cpu()
    starts = torch.nonzero(torch.diff(d, prepend=d[:1] - 1)).flatten()
    return torch.cat([starts, torch.tensor([len(d)])])


def row_documents(doc_ids_BT: torch.Tensor | None, B: int, T: int) -> torch.Tensor:
    """The host offsets of the documents of B rows of T tokens laid end to end: each row one
    document, or with ``doc_ids_BT`` (packed rows) every document and each row's padding."""
    return cu_seqlens(rows_end_to_end(doc_ids_BT)) if doc_ids_BT is not None else torch.arange(0, B * T + 1, T)


def next_token_loss(
    head: nn.Module, h_BTD: torch.Tensor, labels_BT: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean cross-entropy of each next token over the targets (0 without any) and how many of
    them the argmax gets right. ``labels_BT`` holds T labels (position t predicts label t + 1) or
    T + 1 (every position predicts one: a context-parallel rank's slice, whose last token's
    target is the next rank's first). A plain linear head goes through ``kiln_kernels.loss``
    (never the [tokens, vocab] logits; the Triton kernel on CUDA, which counts the argmax hits
    as it goes), its inputs in the autocast dtype as the head's own matmul would take them. Any
    other head (LoRA on it) computes the logits."""
    from kiln_kernels.loss import linear_cross_entropy

    n = labels_BT.shape[1] - 1
    h, y = h_BTD[:, :n].reshape(-1, h_BTD.shape[-1]), labels_BT[:, 1:].reshape(-1)
    if type(head) is not nn.Linear or head.bias is not None:
        target = y != ignore_index
        logits = f32(head(h))
        loss = F.cross_entropy(logits, y, ignore_index=ignore_index, reduction="sum") / target.sum().clamp_min(1)
        return loss, ((logits.argmax(-1) == y) & target).sum()
    W = head.weight
    if torch.is_autocast_enabled(h.device.type):
        dt = torch.get_autocast_dtype(h.device.type)
        h, W = h.to(dt), W.to(dt)
    else:
        h = h.to(W.dtype)
    return linear_cross_entropy(h, W, y, ignore_index)


class Past(Protocol):
    """Where the tokens before a forward's tokens live, for the three places a layer reads them:
    ``engine.parallel.context.ContextShard`` (context parallel: earlier ranks hold them) and
    ``engine.inference.cache.Cache`` (decoding: earlier steps left their states). The forward's
    tokens are one row [1, T] of documents cut by ``cu`` (host offsets); each document continues
    one that began before it, or starts afresh. ``key`` names the caller (a layer and what it
    asks for) so that each layer's state stays its own."""

    def conv(
        self, xs_1TC: list[torch.Tensor], weight_C1W: torch.Tensor, cu: torch.Tensor, head_norms: tuple[int, ...], key
    ) -> list[torch.Tensor]:
        """``kiln_kernels.conv.short_conv`` of each x of a layer (KDA's q, k and v) with its part
        of ``weight_C1W``'s channels (theirs in order) and its head norm, each document's window
        reaching back into the tokens before it."""
        ...

    def delta_rule(self, q, k, v, g, beta, cu: torch.Tensor, key, gate: Gate | None = None) -> torch.Tensor:
        """``kiln_kernels.kda.kda_chunk``'s output, each document starting from the state its
        earlier tokens left (with ``gate``, g is the decay gate's raw projection, as kda_chunk's)."""
        ...

    def keys(self, rows_TC: torch.Tensor, cu: torch.Tensor, key) -> tuple[torch.Tensor, torch.Tensor]:
        """The key rows each document's queries may attend to, [S, C] (its earlier rows, then
        these), and their documents' host offsets ``cu_k``: the queries are the last of each
        document's keys (kiln_kernels.attention's rule)."""
        ...

    def step_keys(self, rows_NC: torch.Tensor, key) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a decode step (every document one token after earlier ones): ``keys`` as each
        document's rows padded to the longest, [N, S, C], and which of them are its own, [N, S];
        None for any other forward (then ``keys``, which this call has not touched)."""
        ...

    def topk(self, q_BTJD, k_BSD, w_BTJ, starts_BT: torch.Tensor, cu: torch.Tensor, cu_k: torch.Tensor, topk: int):
        """``kiln_kernels.dsa.indexer_topk`` over ``keys``' rows: each query's choice among the
        keys of its own document up to itself, as indices into those rows. ``starts_BT``: each
        query's document start in the forward's own row."""
        ...


class CausalLM:
    """The forward of a causal LM class that has ``hidden`` (the final norm's output) and
    ``lm_head``; put first among the bases (``class M(CausalLM, nn.Module)``)."""

    hidden: Callable[..., torch.Tensor]  # the family's: ids (and pixels, documents, positions) -> [B, T, D]
    lm_head: nn.Linear

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        pixels_NCHW: torch.Tensor | None = None,
        doc_ids_BT: torch.Tensor | None = None,
        positions_BT: torch.Tensor | None = None,
        labels_BT: torch.Tensor | None = None,
        past: Past | None = None,
    ):
        """Logits [B, T, vocab]; with ``labels_BT`` instead, the mean next-token cross-entropy over the
        targets and the count of argmax hits (``layers.next_token_loss``: no full logits). ``past``
        (``Past``): the tokens are a continuation, a context-parallel rank's slice or the next
        tokens of a decode."""
        h = self.hidden(input_ids_BT, pixels_NCHW, doc_ids_BT, positions_BT, past)
        return self.lm_head(h) if labels_BT is None else next_token_loss(self.lm_head, h, labels_BT)
