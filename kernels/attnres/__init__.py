from kernels.attnres.reference import depth_attention

__all__ = ["depth_attention"]
