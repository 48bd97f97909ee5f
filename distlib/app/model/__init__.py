"""model: the model families (MiniGPT, GPT-2, Llama, Mixtral with its mixture of experts ``moe``;
``families``), their tensor-parallel plans and pipeline stages (``pipeline``; one step's schedule
over them: ``pipeline_step``), and the conversion to and from Hugging Face configs and weights
(``hf_config``, ``hf_weights``; transformers is optional and imported only there).

Rule: imports the library, ``distlib.app.config`` and ``distlib.app.observe.activations`` (the
seam through which activation checkpointing reports what it keeps); a model knows nothing of
data, checkpoints or the training loop.
"""
