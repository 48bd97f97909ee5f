"""context: one sequence split over the ranks of a context-parallel group (``dist.cp``).

Rank r of a group of N holds chunks r and 2N - 1 - r of every sequence cut into 2N equal chunks
(``chunks``): causal attention gives later tokens more keys, so pairing an early chunk with a late
one gives every rank the same work (with packed documents the chunks are paired anew for each
micro-batch's, ``balance``). Everything outside attention works token by token and runs on
the rank's tokens as they are (positions handed to the model, ``chunks.positions``); attention
needs the other ranks' keys and values, by one of two routes:

``ulysses``: the all-to-all route (DeepSpeed-Ulysses): sequence shards -> head shards, every rank
attends the whole sequence for 1/N of the heads, then back; needs the heads divisible by N.
``ring``: the keys and values travel around the group, each rank merging its partial attention by
log-sum-exp in a fixed order; the backward by the same ring.

Rule: imports ``distlib.comm`` and ``distlib.parallel``; knows no model: attention arrives as
tensors and a function.
"""
