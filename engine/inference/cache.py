"""The decode cache: what each layer keeps of a sequence's tokens so that the next tokens need no
recompute of the earlier ones (``layers.Past``, the same three places context parallel fills):

- KDA's short convolutions: the last W - 1 inputs of q, k and v ([slots, W - 1, C]);
- KDA's state: one [H, K, V] fp32 matrix per head, whatever the length (the reason these models
  decode in constant memory per token);
- full attention's key rows: MLA's and DSA's compressed row (kv_lora_rank + rope dims, and DSA's
  index key), kiln-tiny's keys and values, one row a token ([slots, capacity, C], doubled as
  sequences grow).

A forward's tokens are one row of documents, document d the next tokens of the sequence in slot
``slots[d]``, after the ``past[d]`` tokens that slot holds (0: a fresh sequence, whose kept state
is ignored). ``begin`` names them, ``advance`` counts them in once the forward is done.

Legend: N documents of the forward, T tokens, C channels, S key rows, W the filter's width.
"""

from __future__ import annotations

from itertools import groupby

import torch
import torch.nn.functional as F

from engine.inference.adapters import key_layout
from kiln_kernels.conv import short_conv
from kiln_kernels.conv.reference import head_l2_norm
from kiln_kernels.dsa import indexer_topk
from kiln_kernels.kda import Gate, kda_chunk, kda_gate, kda_step
from kiln_kernels.widths import cast, wide_dtype


def conv_step(window_NWC: torch.Tensor, weight_C1W: torch.Tensor) -> torch.Tensor:
    """kiln_kernels.conv's definition at one token a sequence, from its window of the last W
    inputs [N, W, C]: the sum in fp32, SiLU, the result in autocast's dtype (the conv's); q's and
    k's L2 norm per head (in fp32) is the caller's."""
    dev = window_NWC.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else window_NWC.dtype
    up = wide_dtype(window_NWC.dtype)
    return cast(F.silu((cast(window_NWC, up) * cast(weight_C1W[:, 0].t(), up)).sum(1)), dt)


def offsets(lengths: list[int]) -> torch.Tensor:
    """Host offsets [N + 1] of documents of these lengths laid end to end."""
    return torch.tensor([0, *lengths]).cumsum(0)


class Cache:
    """Every layer's kept state for ``slots`` sequences on ``device`` (a ``layers.Past``)."""

    def __init__(self, slots: int, device: torch.device | str = "cpu"):
        self.slots_total, self.device = slots, torch.device(device)
        self.length = [0] * slots  # tokens each slot holds
        self.kept: dict = {}  # (layer id, what) -> tensor [slots, ...]
        self.slots: list[int] = []
        self.past: list[int] = []
        self.new: list[int] = []
        self.stepping = False
        self.span: tuple[int, int] | None = None  # the slots, where they are consecutive and in order

    def begin(self, slots: list[int], new: list[int]) -> list[int]:
        """The next forward: ``new[d]`` tokens for slot ``slots[d]``; returns their positions [T]
        (each slot's token count so far onwards: RoPE's positions)."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot appears twice in one forward: {slots}")
        self.slots, self.new = list(slots), list(new)
        self.past = [self.length[s] for s in slots]
        # every document one token that follows earlier ones: the batched one-step forms, no fresh state
        self.stepping = all(n == 1 for n in new) and all(self.past)
        # one copy to the device a forward (each is a wait for the device: never one a layer)
        both = torch.tensor([slots, [p == 0 for p in self.past], self.past]).to(self.device)
        self.index, self.fresh, self.at = both[0], both[1].bool(), both[2]
        first = slots[0] if slots else 0
        self.span = (first, first + len(slots)) if slots == list(range(first, first + len(slots))) else None
        return [p + i for p, n in zip(self.past, new, strict=True) for i in range(n)]

    def advance(self) -> None:
        for s, n in zip(self.slots, self.new, strict=True):
            self.length[s] += n

    def free(self, slot: int) -> None:
        self.length[slot] = 0

    def copy(self, src: int, dst: list[int]) -> None:
        """Slots ``dst`` continue as ``src`` does (the n choices of one prompt share its prefill)."""
        for t in self.kept.values():
            t[dst] = t[src].clone()
        for s in dst:
            self.length[s] = self.length[src]

    def _of(self, t: torch.Tensor) -> torch.Tensor:
        """The forward's slots' rows of a kept tensor: a view where the slots are consecutive and
        in order (a decode step's usual case), else a gather."""
        return t[self.span[0] : self.span[1]] if self.span is not None else t[self.index]

    def _set(self, t: torch.Tensor, rows: torch.Tensor) -> None:
        """The forward's slots' rows of t become rows (a copy into the view, else a scatter)."""
        if self.span is not None:
            t[self.span[0] : self.span[1]].copy_(rows)
        else:
            t[self.index] = rows

    def _tensor(self, key, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = self.kept.get(key)
        if t is None or t.shape[1:] != shape or t.dtype != dtype:
            t = self.kept[key] = torch.zeros(self.slots_total, *shape, dtype=dtype, device=self.device)
        return t

    def conv(
        self, xs_1TC: list[torch.Tensor], weight_C1W: torch.Tensor, cu: torch.Tensor, head_norms: tuple[int, ...], key
    ) -> list[torch.Tensor]:
        """The layer's inputs side by side in one tail ([slots, W - 1, their channels]): a decode
        step convolves them as one window, each part then normed as its own."""
        W, widths = weight_C1W.shape[-1], [x.shape[-1] for x in xs_1TC]
        tail = self._tensor(key, (W - 1, sum(widths)), xs_1TC[0].dtype)
        before = self._of(tail)  # [N, W - 1, C]
        if self.stepping:  # one window of W a sequence (none of them fresh): the definition, batched
            window = torch.cat([before, torch.cat(xs_1TC, -1)[0, :, None]], 1)
            self._set(tail, window[:, 1:])
            y, at, out = conv_step(window, weight_C1W), 0, []
            for norm, run in groupby(zip(widths, head_norms, strict=True), key=lambda p: p[1]):
                ws = [w for w, _ in run]  # side by side with one head norm (q's and k's): normed as one
                end = at + sum(ws)
                block, at = y[:, at:end], end
                out += (head_l2_norm(block, norm) if norm else block)[None].split(ws, -1)
            return out
        before = torch.where(self.fresh[:, None, None], 0, before)  # zeros before a fresh one
        bounds = cu.tolist()
        out, kept = [], []
        for x_1TC, w, b_NWC, norm in zip(
            xs_1TC, weight_C1W.split(widths), before.split(widths, -1), head_norms, strict=True
        ):
            parts, keep = [], []
            for d, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
                parts.append(torch.cat([b_NWC[d], x_1TC[0, a:b]]))
                keep.append(torch.arange(b - a) + a + (W - 1) * (d + 1))
            y = short_conv(torch.cat(parts)[None], w, offsets([len(p) for p in parts]), norm)
            out.append(y[:, torch.cat(keep).to(y.device)])
            kept.append(torch.stack([p[-(W - 1) :] for p in parts]))
        self._set(tail, torch.cat(kept, -1))
        return out

    def delta_rule(self, q, k, v, g, beta, cu: torch.Tensor, key, gate: Gate | None = None) -> torch.Tensor:
        H, K, V = q.shape[2], q.shape[3], v.shape[3]
        state = self._tensor(key, (H, K, V), torch.promote_types(v.dtype, torch.float32))
        h0 = self._of(state)
        if self.stepping:  # one token each (none of them fresh): the recurrence's step, N sequences as a batch
            decay = kda_gate(g[0], *gate) if gate is not None else g[0]
            o, final = kda_step(q[0], k[0], v[0], decay, beta[0], h0)
            o = o[None]
        else:
            h0 = torch.where(self.fresh[:, None, None, None], 0, h0)  # a fresh one starts from zeros
            o, final = kda_chunk(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, gate=gate)
        self._set(state, final.to(state.dtype))
        return o

    def _key_rows(self, rows_TC: torch.Tensor, need: int, key) -> tuple[torch.Tensor, torch.Tensor]:
        """The new rows in the kept dtype, and the kept rows [slots, capacity >= need, C]. Kept in
        autocast's dtype when autocast is on (MLA's fp32 latent, from its norm, only ever enters
        kv_b_proj's matmul, which casts it anyway): half the memory, the same sums."""
        dev = rows_TC.device.type
        if torch.is_autocast_enabled(dev) and rows_TC.dtype == torch.float32:
            rows_TC = rows_TC.to(torch.get_autocast_dtype(dev))
        kept = self.kept.get(key)
        if kept is None or kept.shape[1] < need or kept.dtype != rows_TC.dtype:
            cap = max(64, 1 << (need - 1).bit_length())
            grown = torch.zeros(self.slots_total, cap, rows_TC.shape[-1], dtype=rows_TC.dtype, device=self.device)
            if kept is not None and kept.dtype == rows_TC.dtype:
                grown[:, : kept.shape[1]] = kept
            kept = self.kept[key] = grown
        return rows_TC, kept

    def step_keys(self, rows_NC: torch.Tensor, key) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.stepping:
            return None
        need = max(self.past) + 1
        rows_NC, kept = self._key_rows(rows_NC, need, key)
        kept[self.index, self.at] = rows_NC
        valid = torch.arange(need, device=self.device) <= self.at[:, None]
        return self._of(kept[:, :need]), valid

    def keys(self, rows_TC: torch.Tensor, cu: torch.Tensor, key) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = [p + n for p, n in zip(self.past, self.new, strict=True)]  # each document's keys
        rows_TC, kept = self._key_rows(rows_TC, max(lengths), key)
        bounds = cu.tolist()
        out = []
        for s, p, a, b in zip(self.slots, self.past, bounds, bounds[1:], strict=False):
            kept[s, p : p + b - a] = rows_TC[a:b]
            out.append(kept[s, : p + b - a])
        cu_k = offsets(lengths)
        key_layout(cu_k)
        return torch.cat(out), cu_k

    def topk(self, q_BTJD, k_BSD, w_BTJ, starts_BT: torch.Tensor, cu: torch.Tensor, cu_k: torch.Tensor, topk: int):
        """Each document's choice among its own keys (the queries its last ones), as indices into
        every document's keys laid end to end; -1 pads a document that has fewer keys."""
        a, b = cu.tolist(), cu_k.tolist()
        parts = []
        for d in range(len(a) - 1):
            q, w = q_BTJD[:, a[d] : a[d + 1]], w_BTJ[:, a[d] : a[d + 1]]
            starts = torch.zeros(1, a[d + 1] - a[d], dtype=torch.long, device=q.device)
            idx = indexer_topk(q, k_BSD[:, b[d] : b[d + 1]], w, starts, topk)
            parts.append(torch.where(idx >= 0, idx + b[d], -1))
        width = max(p.shape[-1] for p in parts)
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[-1]), value=-1) for p in parts], 1)
