"""runtime: what surrounds a worker process and what attaches to it from outside.

``devices`` (which device a rank computes on), ``launcher_env`` (what the launcher says through
the environment), ``hooks`` (the fixed points of a step where outside code may act) and
``faults`` (the recovery drills, a ``StepHooks`` plugin on those seams, and the ``fault`` config
group).

Rule: may import ``distlib.comm``, ``distlib.parallel``, ``distlib.checkpoint``,
``distlib.app.config`` and ``distlib.app.runtime``.
"""
