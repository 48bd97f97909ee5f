"""distlib: hand-written collectives, DDP, ZeRO 1-3, tensor parallelism and
verified sharded checkpoints for a small GPT, on torch.distributed.

One concern per module; see README.md for how the pieces fit.
"""
