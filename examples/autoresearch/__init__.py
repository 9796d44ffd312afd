"""Autoresearch: many RL experiments at once against one Tinker-compatible gateway.

A driver (:mod:`.driver`) keeps ``--parallel`` experiments running, each a config
(:class:`.experiment.ExperimentConfig`: learning rate, LoRA rank, loss, group size, reward
variant) proposed by a pluggable proposer (:mod:`.proposers`: optuna with pruning, or an
external command), and records every step in a leaderboard (:mod:`.leaderboard`).

    python examples/autoresearch --experiments 8 --parallel 4 --steps 5 --out ar-out
    openrl run examples/autoresearch -- --experiments 8 --parallel 4 --steps 5 --out ar-out

See docs/recipes/autoresearch.md.
"""
