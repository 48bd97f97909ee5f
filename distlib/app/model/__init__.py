"""model: the model families, their tensor-parallel plans and their pipeline stages.

Rule: imports the library, ``distlib.app.config`` and ``distlib.app.observe.activations`` (the
seam through which activation checkpointing reports what it keeps); a model knows nothing of
data, checkpoints or the training loop.
"""
