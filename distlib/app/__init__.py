"""app: the MiniGPT training application built on the library.

The validated run configuration (``config``), the model (``model``), data and tokens (``data``,
``tokens``), the trainer that composes the library's narrow APIs (``trainer``), the checkpointing
component (``checkpointer``), metrics, the capstone's printed summary and invariants (``summary``),
sampling from a checkpoint (``sampling``) and what lets a run be left alone (``unattended``: the
divergence guard, rollback targets, stop/save decisions, fault injection).

Rule: may import ``distlib.comm``, ``distlib.parallel``, ``distlib.checkpoint`` and
``distlib.app``; never ``distlib.launch``, Hydra or OmegaConf (``config`` builds typed
dataclasses from a plain dict).
"""
