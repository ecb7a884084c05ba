"""DAPO math scorer (`math_dapo`, `math`, `aime*`) with veRL's semantics: the last `Answer: <x>`
line of the response's final 300 characters, Minerva-normalised, against the normalised ground
truth; 1.0 when equal, else -1.0.
A response with no `Answer:` line predicts "[INVALID]" and scores -1, even when it holds a
`\\boxed{}` answer. Returns {"score", "acc", "pred"}.

- `strict_box_verify=True` (veRL's option): the last `\\boxed{...}` of the final 100 characters,
  compared unnormalised with the ground truth.
- `lenient=True` (jaxrl_llm's opt-in, not veRL's): with no `Answer:` line, fall back to the last
  `\\boxed{...}` of the final 100 characters (normalised). Turn it on with
  `custom_reward_function.reward_kwargs={lenient: true}` (with no custom path, the kwargs go to
  the built-in scorers).
"""
from __future__ import annotations

import re

from jaxrl_llm.rewards.scorers.math_boxed import closing_brace

_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters",
    "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}",
    "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ",
    "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)


def normalise_final_answer(answer: str) -> str:
    """Minerva-style normalisation of a final answer (units, TeX wrappers, shorthand fractions)."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expression in _REMOVED:
        answer = answer.replace(expression, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def _last_boxed_content(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = closing_brace(text, start)
    return None if end is None else text[start + len("\\boxed{"):end]


def verify(response: str, ground_truth: str, strict_box_verify: bool = False,
           lenient: bool = False) -> tuple[bool, str]:
    """(correct, prediction) for an already tail-cut response."""
    if strict_box_verify:
        pred = _last_boxed_content(response[-100:])
        pred = "[INVALID]" if pred is None else pred
        return pred == ground_truth, pred
    found = _ANSWER.findall(response)
    pred = normalise_final_answer(found[-1] if found else "[INVALID]")
    if not found and lenient:
        boxed = _last_boxed_content(response[-100:])
        if boxed is not None:
            pred = normalise_final_answer(boxed)
    return pred == normalise_final_answer(ground_truth), pred


def compute_score(response: str, ground_truth: str, strict_box_verify: bool = False, lenient: bool = False) -> dict:
    correct, pred = verify(response[-300:], str(ground_truth), strict_box_verify, lenient)
    return {"score": 1.0 if correct else -1.0, "acc": bool(correct), "pred": pred}
