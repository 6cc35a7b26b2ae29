from kernels.kda.reference import kda_chunk, kda_gate, kda_recurrent

__all__ = ["kda_chunk", "kda_gate", "kda_recurrent"]
