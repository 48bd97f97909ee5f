"""checkpointing: what goes into a checkpoint of this application, and when it is saved and loaded.

Rule: imports the library (the on-disk format is ``distlib.checkpoint``'s), ``distlib.app.config``,
``distlib.app.model``, ``distlib.app.data``, ``distlib.app.hooks``, ``distlib.app.launcher_env`` and,
of ``distlib.app.unattended``, only ``rollback`` (the calls a rollback makes, ``RollbackSource``,
which the ``Checkpointer`` implements) and ``stopping`` (the save/stop decision); never the
trainer. Every decision is taken once and shared.
"""
