"""Context parallel: one sequence (a long document, or a step's rows laid end to end) split
into ``cp`` contiguous slices, one a rank of a context-parallel group, and the three places where
a layer needs tokens of other ranks:

- KDA's short convolution reads the W - 1 tokens before each token: every rank sends its last
  W - 1 inputs to the next rank (``halo``), all at once.
- KDA's state: a rank's first document may have begun on an earlier rank; its state at the
  slice's start is the previous rank's final state (``state_in`` / ``state_out``). Ranks wait
  for each other layer by layer, a wavefront: exact, and the traffic is one [H, K, V] state per
  rank boundary and layer (MODEL_NOTES, "Long documents and context parallel"); the ranks
  overlap across layers, not inside one.
- Full attention: the queries of this slice against the keys of their documents so far, on
  earlier ranks too: the rows the keys are made from (MLA's latent, 576 wide in Kimi Linear) are
  gathered from every rank (``keys``), the queries aligned with the last keys
  (kiln_kernels.attention's rule).

Each is an autograd Function whose backward moves the gradients the other way, so the whole
step's gradients equal one rank's. Under Swap Core's recompute nothing is sent again: each
exchange keeps what it received (keyed by the caller) and hands it back while
``engine.model.common.recompute.recomputing()``; the forward's own autograd nodes carry the gradients.

``split`` cuts a collated batch into this rank's slice and its ``ContextShard``; the labels are
taken one past the slice (the next rank's first token is its last token's target).

Legend: L tokens of the whole sequence, T of a slice, C channels, H heads, K/V state dims.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.model.common.layers import cu_seqlens, rows_end_to_end
from engine.model.common.recompute import recomputing
from kiln_kernels.conv import short_conv
from kiln_kernels.dsa import indexer_topk
from kiln_kernels.kda import Gate, kda_chunk

IGNORE = -100


def _exchange(group, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
    """Point-to-point sends and receives (group ranks) posted together, then waited for."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, r), group) for t, r in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, r), group) for t, r in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _Halo(torch.autograd.Function):
    """The previous rank's last rows of x (zeros on the first rank); backward: their gradient
    goes back to that rank, and this rank's last rows get the next rank's."""

    @staticmethod
    def forward(ctx, tail, shard):
        ctx.shard = shard
        got = tail.new_zeros(tail.shape)  # contiguous, whatever tail's strides
        r, n = shard.rank, shard.size
        _exchange(shard.group, [(tail, r + 1)] if r + 1 < n else [], [(got, r - 1)] if r > 0 else [])
        return got

    @staticmethod
    def backward(ctx, grad):
        shard = ctx.shard
        back = grad.new_zeros(grad.shape)
        r, n = shard.rank, shard.size
        _exchange(shard.group, [(grad, r - 1)] if r > 0 else [], [(back, r + 1)] if r + 1 < n else [])
        return back, None


class _StateIn(torch.autograd.Function):
    """The previous rank's final state (zeros on the first rank); backward sends its gradient back."""

    @staticmethod
    def forward(ctx, anchor, shape, dtype, shard):
        ctx.shard = shard
        state = torch.zeros(shape, dtype=dtype, device=anchor.device)
        if shard.rank > 0:
            _exchange(shard.group, [], [(state, shard.rank - 1)])
        return state

    @staticmethod
    def backward(ctx, grad):
        shard = ctx.shard
        if shard.rank > 0:
            _exchange(shard.group, [(grad, shard.rank - 1)], [])
        return None, None, None, None


class _StateOut(torch.autograd.Function):
    """Send the final state on; the output passes through, and its backward first takes the
    state's gradient from the next rank."""

    @staticmethod
    def forward(ctx, state, out, shard):
        ctx.shard, ctx.shape = shard, state.shape
        if shard.rank + 1 < shard.size:
            _exchange(shard.group, [(state.detach(), shard.rank + 1)], [])
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        shard = ctx.shard
        d_state = torch.zeros(ctx.shape, dtype=torch.float32, device=grad_out.device)
        if shard.rank + 1 < shard.size:
            _exchange(shard.group, [], [(d_state, shard.rank + 1)])
        return d_state, grad_out, None


class _Gather(torch.autograd.Function):
    """Every rank's slice of x [T, C], in rank order [cp * T, C]; backward: the gradients summed
    over the ranks, this rank's rows kept."""

    @staticmethod
    def forward(ctx, x, shard):
        ctx.shard = shard
        parts = [torch.empty_like(x) for _ in range(shard.size)]
        dist.all_gather(parts, x.contiguous(), group=shard.group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        shard = ctx.shard
        grad = grad.contiguous()
        dist.all_reduce(grad, group=shard.group)
        T = grad.shape[0] // shard.size
        return grad[shard.rank * T : (shard.rank + 1) * T], None


class ContextShard:
    """This rank's slice [start, end) of a sequence of L tokens whose document ids (host, [L])
    are ``docs``; ``group`` holds the ``size`` ranks of the sequence, this one ``rank``-th."""

    def __init__(self, group, rank: int, size: int, docs: torch.Tensor, start: int, end: int):
        self.group, self.rank, self.size, self.docs, self.start, self.end = group, rank, size, docs, start, end
        self._kept: dict = {}  # what each exchange received, for the recompute

    @property
    def continues(self) -> bool:
        """Whether the slice's first document began on an earlier rank."""
        return self.start > 0 and bool(self.docs[self.start - 1] == self.docs[self.start])

    @property
    def first_doc_start(self) -> int:
        """Where (in the whole sequence) the slice's first document begins."""
        d = self.docs[: self.start + 1]
        return int(torch.nonzero(d != d[-1]).max()) + 1 if bool((d != d[-1]).any()) else 0

    def _once(self, key, make):
        """``make()`` in the forward, what it gave back in the recompute."""
        if recomputing():
            return self._kept[key]
        self._kept[key] = out = make()
        return out

    def halo(self, x_1TC: torch.Tensor, n: int, key) -> tuple[torch.Tensor, torch.Tensor]:
        """x with the previous rank's last ``n`` rows before it [1, n + T, C], and the host offsets
        of its documents: the halo belongs to the slice's first document where that began
        earlier, else it is a document of its own (its outputs are dropped)."""
        prev = self._once(key, lambda: _Halo.apply(x_1TC[0, -n:], self))
        ids = torch.cat([self.docs[max(self.start - n, 0) : self.start], self.docs[self.start : self.end]])
        if self.start < n:  # the first rank: n rows of zeros, a document of their own
            ids = torch.cat([torch.full((n - self.start,), -1, dtype=ids.dtype), ids])
        return torch.cat([prev[None].to(x_1TC.dtype), x_1TC], 1), cu_seqlens(ids[None])

    def state_in(self, like: torch.Tensor, shape: tuple[int, ...], n_docs: int, key) -> torch.Tensor:
        """The initial states of the slice's documents [N, H, K, V] (fp32, on ``like``'s device):
        the previous rank's final state for a first document that continues, zeros for the
        others. Its backward always runs while training (a leaf that asks for a gradient anchors
        it): the previous rank waits for this state's gradient whether or not this layer trains."""
        anchor = torch.zeros((), device=like.device, requires_grad=torch.is_grad_enabled())
        prev = self._once(key, lambda: _StateIn.apply(anchor, shape, torch.float32, self))
        first = prev if self.continues else prev * 0.0  # the exchange runs either way: every rank in step
        return torch.cat([first[None], first.new_zeros(n_docs - 1, *shape)])

    def state_out(self, final_state: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Send the slice's last final state on (its gradient comes back through ``out``)."""
        if recomputing():
            return out
        return _StateOut.apply(final_state, out, self)

    def conv(
        self, xs_1TC: list[torch.Tensor], weight_C1W: torch.Tensor, cu: torch.Tensor, head_norms: tuple[int, ...], key
    ) -> list[torch.Tensor]:
        """The short convolutions of the slice, each first window reaching into the previous
        rank's last tokens (``halo``)."""
        n = weight_C1W.shape[-1] - 1
        out = []
        filters = weight_C1W.split([x.shape[-1] for x in xs_1TC])
        for i, (x_1TC, w, norm) in enumerate(zip(xs_1TC, filters, head_norms, strict=True)):
            x, cu_halo = self.halo(x_1TC, n, (key, i))
            out.append(short_conv(x, w, cu_halo, norm)[:, n:])
        return out

    def delta_rule(self, q, k, v, g, beta, cu: torch.Tensor, key, gate: Gate | None = None) -> torch.Tensor:
        """The chunked delta rule from the previous rank's final state; this slice's last final
        state goes on to the next rank."""
        H, K, V = q.shape[2], q.shape[3], v.shape[3]
        h0 = self.state_in(q, (H, K, V), len(cu) - 1, key)
        o, final = kda_chunk(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, gate=gate)
        return self.state_out(final[-1], o)

    def topk(self, q_BTJD, k_BSD, w_BTJ, starts_BT: torch.Tensor, cu: torch.Tensor, cu_k: torch.Tensor, topk: int):
        """The indexer's choice over ``key_rows``: the queries are the last of them."""
        return indexer_topk(q_BTJD, k_BSD, w_BTJ, self.key_starts(starts_BT), topk)

    def key_rows(self, rows_TC: torch.Tensor, key) -> torch.Tensor:
        """The key rows every query of the slice may attend to, [S, C]: the whole sequence's rows
        from the start of the slice's first document to the slice's end (the queries are the last
        T of them)."""
        every = self._once(key, lambda: _Gather.apply(rows_TC, self))
        return every[self.first_doc_start : self.end]

    def keys(self, rows_TC: torch.Tensor, cu: torch.Tensor, key) -> tuple[torch.Tensor, torch.Tensor]:
        """``key_rows``, and their documents' host offsets (the queries', ``cu``, shifted by the
        first document's earlier part)."""
        before = self.start - self.first_doc_start
        return self.key_rows(rows_TC, key), torch.cat([cu[:1], cu[1:] + before])

    def step_keys(self, rows_NC: torch.Tensor, key) -> None:
        """Context parallel runs no decode step."""
        return None

    def key_starts(self, starts_BT: torch.Tensor) -> torch.Tensor:
        """Each query's document start among ``key_rows`` from its start in the slice: the first
        document begins at key 0, the others after the first's earlier part."""
        return torch.where(starts_BT == 0, 0, starts_BT + self.start - self.first_doc_start)


def split(batch: dict, pad_id: int, group, rank: int, size: int) -> tuple[dict, ContextShard]:
    """This rank's slice of a collated batch, its rows laid end to end as one sequence (padded with
    a document of pad tokens to a multiple of ``size``, at least 4 tokens a slice), and its shard.
    The labels run one past the slice. Text only."""
    if batch["pixels_NCHW"].numel():
        raise ValueError("context parallel (parallel.cp_size > 1) takes text-only data for now")
    ids, labels = batch["input_ids_BT"], batch["labels_BT"]
    B, T = ids.shape
    docs = batch["doc_ids_BT"]  # rows laid end to end as the models lay them (unpacked: a row one document)
    docs = rows_end_to_end(docs if docs is not None else torch.zeros(B, T, dtype=torch.long))[0]
    pos = batch["positions_BT"] if batch["positions_BT"] is not None else torch.arange(T).expand(B, T)
    L = B * T
    per = max(-(-L // size), 4)
    pad = per * size - L
    labels = labels.clone()
    labels[:, 0] = IGNORE  # nothing predicts a row's first token (one process: labels[:, 1:]), nor may the row before
    ids = torch.cat([ids.reshape(-1), torch.full((pad,), pad_id)])
    labels = torch.cat([labels.reshape(-1), torch.full((pad + 1,), IGNORE)])
    docs = torch.cat([docs.reshape(-1), torch.full((pad,), int(docs.max()) + 1)])
    pos = torch.cat([pos.reshape(-1), torch.arange(pad)])
    s, e = rank * per, (rank + 1) * per
    local = {
        "input_ids_BT": ids[None, s:e],
        "labels_BT": labels[None, s : e + 1],
        "pixels_NCHW": batch["pixels_NCHW"],
        "doc_ids_BT": docs[None, s:e],
        "positions_BT": pos[None, s:e],
    }
    return local, ContextShard(group, rank, size, docs, s, e)
