"""data: the corpus, text as tokens, and which batch each rank reads at each step.

Rule: imports the library and ``distlib.app.config``; the data a step reads is a function of
(seed, step, skipped batches) alone, so nothing here keeps state a checkpoint would not restore.
"""
