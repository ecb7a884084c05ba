"""Multiple-choice scorer (`crossthinkqa`), ROLL's CrossThinkQARuleRewardWorker: the answer is the last
`\\boxed{...}` (format kept), else the text after the last "answer is", else the whole response, of the
text after the last `</think>`; it is right when its first capital letter is the ground truth's first
character. The reward by `reward_type` (custom_reward_function.reward_kwargs.reward_type, ROLL's worker key):

                      right, boxed   right, not boxed   wrong, boxed   wrong, not boxed
    loose                 1.0              1.0             -1.0            -1.0
    soft (default)        1.0              0.5             -0.5            -1.0
    strict                1.0             -1.0             -1.0            -1.0

plus ROLL's repetition penalty (3-grams of the whole response, at most -0.5). `acc` is 1 / 0 (ROLL's
`scores`: the reward > 0). ROLL's length reward is left out: its examples weight it 0.
"""
from __future__ import annotations

import re
from typing import Any

from jaxrl_llm.rewards.scorers.text import after_last_think, repetition_penalty_reward

SOURCES = ("crossthinkqa",)
REWARDS = {  # (right, boxed) -> reward, per reward_type
    "loose": {(True, True): 1.0, (True, False): 1.0, (False, True): -1.0, (False, False): -1.0},
    "soft": {(True, True): 1.0, (True, False): 0.5, (False, True): -0.5, (False, False): -1.0},
    "strict": {(True, True): 1.0, (True, False): -1.0, (False, True): -1.0, (False, False): -1.0},
}
_BOXED = re.compile(r"\\boxed\{([^}]+)\}")


def extract_choice(text: str) -> tuple[str, bool]:
    """(the answer text, whether it was boxed)."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1], True
    at = text.lower().rfind("answer is")
    return (text if at < 0 else text[at + len("answer is"):]), False


def compute_score(solution_str: str, ground_truth: Any, reward_type: str = "soft") -> dict[str, float]:
    if reward_type not in REWARDS:
        raise ValueError(f"reward_type={reward_type!r}: one of {', '.join(REWARDS)} (ROLL's crossthinkqa worker)")
    answer, boxed = extract_choice(after_last_think(solution_str))
    letter = next((ch for ch in answer if ch.isupper()), None)
    right = letter is not None and letter == str(ground_truth)[:1]
    reward = REWARDS[reward_type][(right, boxed)]
    return {"score": reward + repetition_penalty_reward(solution_str, 3, -0.5), "acc": float(reward > 0),
            "format": float(boxed)}
