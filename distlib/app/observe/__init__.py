"""observe: what a run reports about itself: metrics, throughput, traces, stragglers, activations.

Rule: imports the library and ``distlib.app.config`` only, and changes no control flow: removing
an observer leaves the run's arithmetic and decisions bit for bit the same.
"""
