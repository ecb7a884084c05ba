"""GSM8K scorer with veRL's semantics: the last `#### <number>` in the response, commas and `$`
removed, compared as a string with the ground truth; 1.0 when equal, `format_score` (0.0) when a
`####` answer is present but wrong, 0.0 when there is none. `method="flexible"` takes the last
number anywhere in the response instead. A ground truth that is the dataset's whole solution (the
raw openai/gsm8k `answer` column, read through data.ground_truth_key) is reduced to its final
`#### N` number, as veRL's preprocessing stores it."""
from __future__ import annotations

import re

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_answer(response: str, method: str = "strict") -> str | None:
    if method == "strict":
        found = _STRICT.findall(response)
        return found[-1].replace(",", "").replace("$", "") if found else None
    if method == "flexible":
        candidates = [c for c in _NUMBER.findall(response) if c not in ("", ".")]
        return candidates[-1] if candidates else None
    raise ValueError(f"gsm8k extraction method must be 'strict' or 'flexible', got {method!r}")


def reference_answer(ground_truth: str) -> str:
    """The number after the last `#### ` of a full GSM8K solution; anything else unchanged."""
    found = _STRICT.findall(ground_truth)
    return found[-1].replace(",", "").replace("$", "") if found else ground_truth


def compute_score(response: str, ground_truth: str, method: str = "strict",
                  format_score: float = 0.0, score: float = 1.0) -> float:
    ground_truth = reference_answer(ground_truth)
    answer = extract_answer(response, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score
