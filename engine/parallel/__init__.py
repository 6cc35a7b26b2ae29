"""Parallelism, applied from outside the single-device model code in one fixed order:
``Mesh`` (mesh.py) -> expert parallel (expert.py: each rank keeps E / ep experts, tokens travel by
all-to-all) -> FSDP2 (fsdp.py: ``fully_shard`` of the experts over the expert-data-parallel ranks,
of every block and the root over all ranks). ``launch.py`` runs a job under torchrun.
"""
