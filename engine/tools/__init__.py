"""Command-line tools beside the engine, not under it: ``python -m engine.tools.plan`` (how many
GPUs and which layout a model and length need) and ``python -m engine.tools.convert`` (checkpoint
conversions: MXFP4 to BF16, Hugging Face shards to DCP). The engine imports neither."""
