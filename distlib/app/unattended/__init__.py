"""unattended: what lets a run be left alone.

The divergence guard and replica check (``guard``), where a guard trip rolls back to
(``rollback``), the per-step save/stop decision from step counts, rank 0's clock and pre-emption
signals (``stopping``), and fault injection for drills and tests (``faults``).

Rule: part of the application (same imports as ``distlib.app``) but never ``checkpointing``: a
rollback reaches the checkpoints through the calls it declares (``rollback.RollbackSource``),
which the Checkpointer implements. Every decision that changes control flow is taken once and
shared through one collective.
"""
