"""The built-in kiln-hybrid-tiny: the K3-style hybrid (KDA + Gated DSA, LatentMoE with SiTU, Block
AttnRes, an image encoder) at test size, initialised from the fixed seed, in Kiln's own layout."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.model.common.kda import ForgetGate
from engine.model.family import BUILTIN_SEED
from engine.model.hybrid.hf import save_hybrid
from engine.model.hybrid.model import HybridForCausalLM
from kiln.tokenizer import ByteTokenizer


def write_tiny(folder: Path) -> None:
    c = ModelConfig.debug(vocab_size=ByteTokenizer.vocab_size)
    c.hidden, c.layers, c.attn_res_block = 128, 4, 4  # 3 KDA : 1 Gated DSA, two AttnRes blocks
    c.kda.heads, c.kda.head_dim = 4, 32
    model = HybridForCausalLM(c, image_token_id=ByteTokenizer().special("<|image|>"))
    g = torch.Generator().manual_seed(BUILTIN_SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            elif name.endswith("bias") or "attn_res" in name or "position_embedding" in name:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        for m in model.modules():
            if isinstance(m, ForgetGate):
                m.A_log.copy_(torch.empty_like(m.A_log).uniform_(1.0, 16.0, generator=g).log())
    save_hybrid(model, folder)
