"""pipeline: pipeline parallelism for any stack of ``nn.Module`` chunks.

``schedule`` builds a schedule (GPipe, 1F1B, interleaved 1F1B) as plain per-rank action lists and
checks them (every send received, no deadlock, in-flight activations); ``executor`` runs one
rank's list over point-to-point messages on the pipeline group; ``recorder`` keeps the measured
events (bubble, activation memory) that benchmarks/pipeline.py and scripts/pipeline_timeline.py read.
"""
