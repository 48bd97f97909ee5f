"""parallel: the parallelism algorithms, for any ``nn.Module``.

The flat parameter layout (``flat_layout``), the one-time replication of rank 0's weights
(``broadcast``), AdamW on flat tensors (``adamw``), Megatron-style tensor parallelism by swapping
``nn.Linear`` layers for column/row-parallel ones (``tensor_parallel``) and the ZeRO stages, one
module per stage (``zero``).

Rule: imports ``distlib.comm`` and ``distlib.parallel`` only. It knows ``nn.Module`` and plain
arguments (a ``Comm``, a stage number, an ``AdamWConfig``), never MiniGPT, the checkpoint format,
the application or its configuration tree.
"""
