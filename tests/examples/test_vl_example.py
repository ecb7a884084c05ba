"""configs/grpo_vl_tiny.py runs through launch/train.py as a user runs it (one CPU device, a subprocess): GRPO on
the synthetic picture task with a tiny random Qwen2.5-VL, the sampler's log-probs the trainer's at every step."""
import pytest
from tiny_runs import train_example

pytestmark = pytest.mark.usefixtures("smollm2_gguf")  # the tiny run's tokenizer


def test_grpo_on_pictures_through_launch(tmp_path):
    rows = train_example(tmp_path / "run", "configs/grpo_vl_tiny.py", "--config.trainer.total_training_steps=2")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout_corr/max_abs_log_ratio"] < 1e-5
        assert row["prompt_length/mean"] > 16  # the picture's 16 image tokens
