"""checkpoint: the sharded on-disk format, and moving it between world sizes.

Saving (every rank writes its shard, rank 0 commits a manifest with every file's sha256 by an
atomic rename), verifying, loading, listing and deleting (``sharded``), capturing and restoring the
random generators (``rng``), resharding or consolidating a checkpoint (``reshard``), and reading
the whole model's tensors out of a checkpoint of any layout (``assemble``).

Rule: imports ``distlib.comm``, ``distlib.checkpoint`` and, from ``distlib.parallel``, only the
flat layout, the tensor-parallel split descriptions (and how split pieces join) and the AdamW
state names -- never an optimizer class, the model, the application or its configuration tree.
"""
