"""comm: who talks to whom, and how -- the bottom layer.

Process groups (``group.Comm``, passed explicitly everywhere, never a global default), the
hand-written collectives built on ``torch.distributed`` point-to-point (``collectives``, with their
header check and per-kind traffic statistics), helpers for values and decisions every rank must
share (``agree``), the data x tensor-parallel mesh (``mesh``) and the watchdog that turns a stalled
collective into an error naming the ranks that did not arrive (``watchdog``).

Rule: a module here imports torch and the standard library, and nothing of distlib outside
``distlib.comm``. It knows no model, optimizer, checkpoint or configuration tree.
"""
