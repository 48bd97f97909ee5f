"""Imported first by multiprocessing's own fork server (``local.PRELOAD``), the fresh interpreter
that imports the workers' modules once and forks each worker from there, where ``python train.py``'s
launcher could not fork one itself (``prefork.py``: a thread already ran in it): it dies with the
launcher.

The fork server outlives its launcher otherwise: multiprocessing hands every process it forks the
pipe whose end tells the server its clients are gone, so the server stays while a worker runs,
and a worker that dies with its parent (the server) would then train on after a SIGKILLed launcher
(tests/test_job_lifecycle.py). The import is the one place the fork server runs our code before
it forks; the call is made here, at import, for that reason."""

from distlib.launch.parent import die_with_parent

die_with_parent()
