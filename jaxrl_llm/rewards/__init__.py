"""Rewards: rule-based scorers, custom reward functions, reward managers, reward model."""
