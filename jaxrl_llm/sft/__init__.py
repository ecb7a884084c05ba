"""Supervised fine-tuning on the RL stack: veRL's SFT data layouts (sft/data.py), batches in the RL
passes' layout (sft/batch.py), the token-mean cross-entropy update (sft/loss.py) and the loop
(sft/trainer.py, run by `launch/sft.py`)."""
from jaxrl_llm.sft.data import SftExample, SftSpec, encode_rows, read_sft_examples
from jaxrl_llm.sft.trainer import SftTrainer, resolve_sft, sft_batch_plan, sft_step, sft_view

__all__ = ["SftExample", "SftSpec", "SftTrainer", "encode_rows", "read_sft_examples", "resolve_sft",
           "sft_batch_plan", "sft_step", "sft_view"]
