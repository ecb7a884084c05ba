"""The RL loop: rollout -> experience -> update; metrics; validation; checkpoints."""
