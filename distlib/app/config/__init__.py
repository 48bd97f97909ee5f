"""config: the run configuration, every key's default, type and range in one place.

Rule: plain dataclasses built from a plain dict (what Hydra composed); imports the library, this
package, ``distlib.app.devices`` and the drill plugin's own group (``distlib.app.faults``), and no
other part of the application: everything else reads the configuration, never the other way round.
"""
