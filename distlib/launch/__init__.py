"""launch: how processes start and end around the application -- the top layer under train.py.

``worker`` (one rank: join, train, report, leave; it dies with its launcher), ``local`` (``python
train.py``'s own launcher: torch's elastic agent, the workers forked from a fork of it: ``prefork``),
``torchrun`` (the agent's store: the start agreement, rank 0's composed config for the others,
deterministic kernels), ``run_lock`` (one job per run directory), ``slurm`` (an srun task -> a
rank), ``hydra_config`` (every key's default handed to Hydra; Hydra's files), ``config_reference``
(docs/config.md) and ``sweep_table`` (the table that ends a Hydra sweep).

Rule: may import everything in distlib, Hydra and OmegaConf; nothing in distlib imports it
except ``train.py`` at the top.
"""
