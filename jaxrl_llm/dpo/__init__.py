"""Direct preference optimisation on the RL stack: preference rows as TRL / veRL store them
(dpo/data.py), TRL's sigmoid / ipo / hinge losses and metrics (dpo/loss.py), the run (dpo/trainer.py,
`launch/dpo.py`), built on the SFT run (jaxrl_llm/sft)."""
from jaxrl_llm.dpo.data import DpoSpec, PreferencePair, read_pairs
from jaxrl_llm.dpo.loss import pair_losses, pair_metrics
from jaxrl_llm.dpo.trainer import DpoTrainer, dpo_view, resolve_dpo

__all__ = ["DpoSpec", "DpoTrainer", "PreferencePair", "dpo_view", "pair_losses", "pair_metrics", "read_pairs",
           "resolve_dpo"]
