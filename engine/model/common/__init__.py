"""Blocks every model family shares: small layers, MoE, Attention Residuals, the image encoder,
the KDA and Gated DSA attention blocks, and the helpers the families' Hugging Face adapters share.
Single-device code: parallelism, LoRA, recompute and checkpoints are applied from outside."""
