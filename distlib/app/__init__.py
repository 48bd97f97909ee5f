"""app: the training application built on the library, in sub-packages by concern.

``config`` (every key: default, type, range, meaning; checked in one place; the learning-rate
schedule), ``model`` (the model families, their tensor-parallel plans, pipeline stages and
Hugging Face conversion), ``data`` (corpus, text tokens, batches), ``checkpointing`` (what a
checkpoint of this run holds, when it is saved and loaded -- a fresh start from
``model.init_from`` included --, which are kept, the resume check, sampling and the Hugging Face
export), ``observe`` (metrics, throughput, traces, stragglers, validation loss, the run's result
and its printed summary and checks), ``unattended`` (the divergence guard, rollback, save/stop
decisions) and ``runtime`` (the device, the launcher's environment, the seams outside code
attaches to and the drill plugin that does). At the top, alone: the trainer that composes them
(``trainer``).

Rule: may import ``distlib.comm``, ``distlib.parallel``, ``distlib.checkpoint`` and
``distlib.app``; never ``distlib.launch``, Hydra or OmegaConf (``config`` builds typed
dataclasses from a plain dict). Each sub-package's own rule is in its ``__init__.py``.
"""
