"""The image encoder: a small ViT (non-overlapping patches, a linear patch embedding, learned
positions, transformer blocks, a norm). kiln-tiny has the embedding alone, the hybrid a few blocks.

Legend: N images, P patches per image, D hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.common.layers import RMSNorm


class ViTBlock(nn.Module):
    """Pre-norm transformer encoder block over the patches (full attention, no mask)."""

    def __init__(self, hidden: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x_NPD: torch.Tensor) -> torch.Tensor:
        N, P, D = x_NPD.shape
        q, k, v = self.qkv(self.norm1(x_NPD)).view(N, P, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        x_NPD = x_NPD + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(N, P, D))
        return x_NPD + self.fc2(F.gelu(self.fc1(self.norm2(x_NPD))))


class VisionTower(nn.Module):
    """A small ViT: non-overlapping patches, a linear patch embedding, learned positions,
    ``layers`` transformer blocks (0: the embedding alone, as kiln-tiny has it), a norm."""

    def __init__(self, patch: int, hidden: int, tokens: int, eps: float, layers: int = 0, heads: int = 4):
        super().__init__()
        self.patch = patch
        self.patch_embed = nn.Linear(3 * patch**2, hidden)
        self.position_embedding = nn.Parameter(torch.zeros(tokens, hidden))
        self.blocks = nn.ModuleList(ViTBlock(hidden, heads, eps) for _ in range(layers))
        self.norm = RMSNorm(hidden, eps)

    def forward(self, pixels_NCHW: torch.Tensor) -> torch.Tensor:
        N, C, H, W = pixels_NCHW.shape
        p = self.patch
        x = pixels_NCHW.unfold(2, p, p).unfold(3, p, p)  # N C H/p W/p p p
        x = self.patch_embed(x.permute(0, 2, 3, 1, 4, 5).reshape(N, -1, C * p * p)) + self.position_embedding
        for block in self.blocks:
            x = block(x)
        return self.norm(x)
