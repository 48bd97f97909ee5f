"""checkpointing: what goes into a checkpoint of this application, and when it is saved and loaded.

Rule: imports the library (the on-disk format is ``distlib.checkpoint``'s), ``distlib.app.config``,
``distlib.app.model``, ``distlib.app.data``, ``distlib.app.unattended``, ``distlib.app.hooks`` and
``distlib.app.launcher_env``; never the trainer. Every decision is taken once and shared.
"""
