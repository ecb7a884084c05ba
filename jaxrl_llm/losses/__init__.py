"""RL mathematics: logprobs, KL, policy/value/entropy losses, aggregation, advantages, rollout correction.

What each registered name computes: docs/algorithms.md.
"""
