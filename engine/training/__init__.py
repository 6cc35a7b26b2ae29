"""The trainer's components (engine/trainer.py composes them):

- ``hyper``: the job's resolved hyperparameters and the learning-rate schedule;
- ``ranks``: where the step runs, one process or a mesh (share the work, sum the counts,
  broadcast the stop, clip, place the model); the single process's do nothing;
- ``objective``: what trains (LoRA or the full model), what a checkpoint holds of it, what the
  job's result is;
- ``checkpointer``: exact resume, one process's files or a mesh's sharded DCP, one interface;
- ``step``: the loss of a batch, a step's forward and backward over its micro-batches, evaluation.
"""
