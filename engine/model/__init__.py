"""Model code, single-device: ``common/`` holds the blocks the families share (layers, MoE,
AttnRes, the image encoder, the KDA and Gated DSA attention blocks, the Hugging Face reading
helpers), and each family is a folder (``tiny``, ``kimi_linear``, ``hybrid``, ``deepseek_v32``)
declaring one ``Family`` (``family.py``) in its ``__init__``, its model code in ``model.py``, its
Hugging Face adapter in ``hf.py`` and its built-in models in ``builtin.py``; ``registry.py``
collects them. LoRA, Swap Core, parallelism and checkpoints are applied from outside
(an import-linter contract in pyproject.toml)."""
