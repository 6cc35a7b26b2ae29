"""Kernels that were built and measured but that the engine does not use.

Each one was written to beat what the engine runs, was measured against it (``bench/``, with the
results in bench/RESULTS.md) and did not earn its place on the engine's path, or not yet. It
stays here, apart from the product's ops, with its tests (still run: on CUDA, and at small fp32
shapes through Triton's interpreter on the CPU) so that its numbers can be reproduced and the work
picked up again. Nothing under ``engine/`` imports this package (an import-linter contract in
pyproject.toml) and ``kiln_kernels.dispatch`` never picks it.

- ``grouped_gemm``: the MoE experts' grouped GEMM in Triton (forward and both gradients); the
  engine runs torch._grouped_mm (``kiln_kernels.moe.grouped``).
"""
