"""Using a model: incremental decoding with a cache (``decode``, ``cache``), many LoRA adapters
on one base model's weights (``adapters``), and a thread that batches every request of one base
model (``batcher``). The inference server (workers/inference.py) serves it over HTTP; the trainer
uses the decoder for its answers on the validation prompts."""

from engine.inference.batcher import Batcher, Handle
from engine.inference.decode import Chunk, Decoder, Prompt, Sampling

__all__ = ["Batcher", "Chunk", "Decoder", "Handle", "Prompt", "Sampling"]
