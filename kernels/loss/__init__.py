from kernels.loss.reference import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
