"""app: the training application built on the library, in sub-packages by concern.

``config`` (every key: default, type, range, meaning; checked in one place), ``model`` (the model
families, their tensor-parallel plans, pipeline stages and Hugging Face conversion), ``data``
(corpus, text tokens, batches), ``checkpointing`` (what a checkpoint of this run holds, when it is
saved and loaded -- a fresh start from ``model.init_from`` included --, the resume check),
``observe`` (metrics, throughput, traces, stragglers, validation loss) and ``unattended`` (the
divergence guard, rollback, save/stop decisions). At the top: the trainer that composes them
(``trainer``), the seams outside code attaches to (``hooks``) and the drill plugin that does
(``faults``), the capstone's printed summary and invariants (``summary``), sampling and the
Hugging Face export (``hf_export``).

Rule: may import ``distlib.comm``, ``distlib.parallel``, ``distlib.checkpoint`` and
``distlib.app``; never ``distlib.launch``, Hydra or OmegaConf (``config`` builds typed
dataclasses from a plain dict). Each sub-package's own rule is in its ``__init__.py``.
"""
