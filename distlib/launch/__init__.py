"""launch: how processes are started around the application -- the top layer under train.py.

torchrun plumbing (``torchrun``: the agent's store, rank 0's composed config shared with the
others, deterministic kernels), SLURM task environments (``slurm``) and the table that ends a
Hydra sweep (``sweep_table``).

Rule: may import everything in distlib, Hydra and OmegaConf; nothing in distlib imports it
except ``train.py`` at the top.
"""
