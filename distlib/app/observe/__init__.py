"""observe: what a run reports about itself: metrics, throughput, traces, stragglers, activations,
and at its end what it returns (``results``) and prints (``summary``: the tables, the checks).

Rule: imports the library, ``distlib.app.config`` and, for the outcome a result carries, the
resume check's type (``distlib.app.checkpointing.resume_check``), and changes no control flow:
removing an observer leaves the run's arithmetic and decisions bit for bit the same.
"""
