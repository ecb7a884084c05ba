"""RL mathematics: logprobs, KL, policy/value/entropy losses, aggregation, advantages, rollout correction."""
