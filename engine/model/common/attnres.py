"""Block Attention Residuals, as K3 uses them: the sources of a site are the sums of the
finished blocks (the embedding is block 0) and the current block's partial sum; inside a block
the sublayer outputs add up as ordinary residuals. Two sites per layer (before attention,
before the MLP) and one before the final norm, each with its own pseudo-query.

``Residuals`` keeps that state for one forward pass; with ``enabled=False`` it is the plain
residual stream (x + f(x)) and has no parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln_kernels.attnres import depth_attention


class AttnResQueries(nn.Module):
    """The pseudo-queries: one per site. Zero-initialised: each site starts as the mean of its
    sources."""

    def __init__(self, sites: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(sites, hidden))


class Residuals:
    def __init__(self, embedding_BTD: torch.Tensor, queries: AttnResQueries | None, block_size: int):
        self.queries, self.block_size = queries, block_size
        self.blocks = [embedding_BTD]  # finished block sums
        self.partial: torch.Tensor | None = None
        self.stream = embedding_BTD  # the plain residual stream, when AttnRes is off
        self.added = 0

    def input(self, site: int) -> torch.Tensor:
        """What sublayer ``site`` reads."""
        if self.queries is None:
            return self.stream
        sources = self.blocks + ([self.partial] if self.partial is not None else [])
        if len(sources) == 1:
            return sources[0]
        return depth_attention(torch.stack(sources), self.queries.weight[site])

    def add(self, out_BTD: torch.Tensor) -> None:
        """A sublayer's output joins the current block (or the plain stream)."""
        if self.queries is None:
            self.stream = self.stream + out_BTD
            return
        self.partial = out_BTD if self.partial is None else self.partial + out_BTD
        self.added += 1
        if self.added % self.block_size == 0:
            self.blocks.append(self.partial)
            self.partial = None
