"""Rollouts: how a step gets its sampled, scored batch.

- `generator.py`: `RolloutGenerator`, one batch of prompts sampled (paged engine or static sampler)
  and scored (rule scorers, reward model, judge) into a `Rollout` (`batch.py`, the host/device record
  of a step's sampled rows);
- `multi_turn.py`: tool-calling and interaction rollouts, several generation rounds per row;
- `sources.py`: where each step's rollout comes from: synchronous, the off-policy pipeline
  (`pipeline.py`, generation ahead of training on a weight copy) or partial rollouts (`partial.py`,
  samples that continue across steps), with DAPO's group filter; `make_rollouts` builds the one
  object the trainer asks for a step's batch.

Rollouts never import the roles: the trainer passes a callable that returns the policy's current
parameters.
"""
