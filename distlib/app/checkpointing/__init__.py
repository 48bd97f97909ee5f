"""checkpointing: what goes into a checkpoint of this application, and when it is saved and loaded;
and the trained model out of it: one process's copy to sample from (``sampling``) and the Hugging
Face export (``hf_export``), the counterpart of a fresh start from one (``init_from``).

Rule: imports the library (the on-disk format is ``distlib.checkpoint``'s), ``distlib.app.config``,
``distlib.app.model``, ``distlib.app.data``, ``distlib.app.runtime.hooks`` and ``.launcher_env`` and,
of ``distlib.app.unattended``, only ``rollback`` (the calls a rollback makes, ``RollbackSource``,
which the ``Checkpointer`` implements) and ``stopping`` (the save/stop decision); never the
trainer. Every decision is taken once and shared.
"""
