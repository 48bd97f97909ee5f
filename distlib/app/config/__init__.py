"""config: the run configuration, every key's default, type and range in one place; and the
learning rate of each step, a pure function of the optimizer's keys (``lr_schedule``).

Rule: plain dataclasses built from a plain dict (what Hydra composed); imports the library, this
package, ``distlib.app.runtime.devices`` and the drill plugin's own group
(``distlib.app.runtime.faults``), and no other part of the application: everything else reads
the configuration, never the other way round.
"""
