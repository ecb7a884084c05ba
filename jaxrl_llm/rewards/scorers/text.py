"""Text helpers the rule scorers share: n-gram repetition and the answer after a reasoning block."""
from __future__ import annotations


def repetition_penalty_reward(text: str, ngram_size: int, max_penalty: float) -> float:
    """max_penalty * (1 - distinct n-grams / n-grams) over lower-cased words; 0 below n words (open-r1's and
    ROLL's formula, from demystify-long-cot)."""
    words = text.lower().split()
    if len(words) < ngram_size:  # the empty response included
        return 0.0
    ngrams = list(zip(*[words[i:] for i in range(ngram_size)]))
    return (1.0 - len(set(ngrams)) / len(ngrams)) * max_penalty


def after_last_think(text: str, end_think: str = "</think>") -> str:
    """The text after the last `</think>`, leading newlines dropped; the whole text when there is none
    (ROLL's extract_after_last_think)."""
    index = text.rfind(end_think)
    return text if index < 0 else text[index + len(end_think):].lstrip("\n")
