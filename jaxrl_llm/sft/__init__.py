"""Supervised fine-tuning on the RL stack: veRL's SFT data layouts (sft/data.py), batches in the RL
passes' layout (sft/batch.py), the token-mean cross-entropy update (sft/loss.py) and the loop
(sft/trainer.py, run by `launch/sft.py`)."""
from jaxrl_llm.config.resolve import resolve_sft
from jaxrl_llm.data.spec import SftSpec
from jaxrl_llm.sft.data import SftExample, encode_rows, read_sft_examples
from jaxrl_llm.sft.steps import sft_batch_plan, sft_step, sft_view
from jaxrl_llm.sft.trainer import SftTrainer

__all__ = ["SftExample", "SftSpec", "SftTrainer", "encode_rows", "read_sft_examples", "resolve_sft",
           "sft_batch_plan", "sft_step", "sft_view"]
