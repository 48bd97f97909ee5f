"""checkpoint: the sharded on-disk format, and moving it between world sizes.

Saving (every rank writes its shard, rank 0 commits a manifest with every file's sha256 by an
atomic rename), verifying, loading, listing and deleting (``sharded``), capturing and restoring the
random generators (``rng``), loading a checkpoint of any layout into any other by parameter name
and global element (``relayout``, which also reads the whole model's tensors), and the offline
tools' consolidate and reshard (``offline``).

Rule: imports ``distlib.comm``, ``distlib.checkpoint`` and, from ``distlib.parallel``, only the
flat layout, the tensor-parallel split descriptions (and how split pieces join) and the AdamW
state names -- never an optimizer class, the model, the application or its configuration tree.
"""
