"""zero: AdamW with optimizer state (stage 1), gradients (2) and parameters (3) sharded over the
data-parallel ranks; stage 0 keeps everything replicated (plain DDP). TODO: one module per stage."""
