"""Command-line tools beside the engine, not under it: ``python -m engine.tools.plan`` (how many
GPUs and which layout a model and length need), ``python -m engine.tools.convert`` (checkpoint
conversions: MXFP4 to BF16, Hugging Face shards to DCP) and ``python -m engine.tools.export`` (an
adapter merged into its base, in the family's layout; the worker's export task runs it too). The
engine imports none of them."""
