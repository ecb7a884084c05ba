"""The models a run holds, one module per role: the trained actor and critic (`trained.py`: params,
optimizer, the jitted update; `actor.py` / `critic.py` their losses, `update.py` the micro-batched
update loop, `optim.py` the optimizers), and the frozen ones that score rollouts: the reference
policy, the distillation teacher, the speculative draft, the reward model and the generative judge.
`forward.py` and `experience.py` hold the no-grad passes and the step's experience (rewards, KL,
advantages) that every role's program reads.

Nothing here knows about rollout sources, the memory plan or the loop: the trainer (jaxrl_llm/trainer)
assembles the roles, the memory plan (jaxrl_llm/planning) compiles their programs.
"""
