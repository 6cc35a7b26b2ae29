"""Kiln's kernels. Each op is a folder with ``reference.py`` (plain PyTorch, readable: the
definition) and, later, fast versions with the same signature; ``kiln_kernels.dispatch`` picks one."""
