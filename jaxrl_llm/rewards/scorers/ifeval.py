"""Instruction-following scorer (`ifeval`): the verifiable constraints of open-instruct's IF functions
(Tulu 3's RLVR data), as ROLL's GeneralRuleRewardWorker reads them. The ground truth is a JSON object
(or a dict) naming one check, `{"func_name": "validate_word_constraint", "N": 100, "quantifier":
"at least"}`; its other keys that the check takes are its arguments. The response's text after the
last `</think>` is checked: 1.0 when it holds, else 0.0 (`acc`), plus ROLL's repetition penalty (3-grams
of the whole response, at most -0.5) in `score`.

One difference from ROLL's copy: `verify_keyword_frequency` counts the keyword (ROLL's copy compares
each word with itself, so counts every word).
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import re
from collections.abc import Callable
from typing import Any

from jaxrl_llm.rewards.scorers.text import after_last_think, repetition_penalty_reward

SOURCES = ("ifeval",)


def _quantified(count: int, n: int, quantifier: str, around: int) -> bool:
    if quantifier == "at least":
        return count >= n
    if quantifier == "at most":
        return count <= n
    if quantifier == "around":
        return abs(count - n) <= around
    return False


def verify_keywords(text: str, keyword_list: list[str]) -> bool:
    return all(k.lower() in text.lower() for k in keyword_list)


def verify_keyword_frequency(text: str, word: str, N: int) -> bool:
    return sum(1 for w in re.findall(r"\b\w+\b", text.lower()) if w == word.lower()) == N


def validate_forbidden_words(text: str, forbidden_words: list[str]) -> bool:
    return not any(w.lower() in text.lower() for w in forbidden_words)


def verify_letter_frequency(text: str, letter: str, N: int) -> bool:
    if len(letter) != 1:
        raise ValueError(f"letter={letter!r}: one character")
    return text.count(letter) == N


def validate_response_language(text: str, language: str) -> bool:
    # an optional package, found when the rows are loaded (parse_constraint)
    return importlib.import_module("langdetect").detect(text) == language


def verify_paragraph_count(text: str, N: int) -> bool:
    text = "\n".join(line.strip() for line in text.splitlines()).strip()
    paragraphs = text.split("* * *")
    return all(p.strip() for p in paragraphs) and len(paragraphs) == N


def validate_word_constraint(text: str, N: int, quantifier: str) -> bool:
    return _quantified(len(text.strip().split()), N, quantifier, around=max(round(N * 0.1), 1))


def verify_sentence_constraint(text: str, N: int, quantifier: str) -> bool:
    sentences = re.split(r"(?<!\w\.\w.)(?<![A-Z][a-z]\.)(?<=\.|\?)\s", text)
    return _quantified(len(sentences), N, quantifier, around=1)


def validate_paragraphs(text: str, N: int, first_word: str, i: int) -> bool:
    paragraphs = text.split("\n\n")
    return len(paragraphs) == N and paragraphs[i - 1].strip().startswith(first_word)


def verify_postscript(text: str, postscript_marker: str) -> bool:
    at = text.find(postscript_marker)
    return at >= 0 and len(text[at:].strip()) > len(postscript_marker)


def validate_placeholders(text: str, N: int) -> bool:
    return len(re.findall(r"\[(.*?)\]", text)) >= N


def verify_bullet_points(text: str, N: int) -> bool:
    return sum(1 for line in text.split("\n") if line.strip().startswith(("*", "-"))) == N


def validate_title(text: str) -> bool:
    return bool(re.findall(r"<<(.*?)>>", text))


def validate_choice(text: str, options: list[str]) -> bool:
    return any(text in option for option in options)


def validate_highlighted_sections(text: str, N: int) -> bool:
    return len(re.findall(r"\*(.*?)\*", text)) >= N


def validate_sections(text: str, N: int, section_splitter: str) -> bool:
    sections = text.split(section_splitter)
    if sections[0] == "":  # the text began with the splitter
        sections.pop(0)
    return len(sections) == N


def validate_json_format(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def validate_repeat_prompt(text: str, original_prompt: str) -> bool:
    return text.startswith(original_prompt)


def validate_two_responses(text: str) -> bool:
    if text.count("******") != 1:
        return False
    first, second = (part.strip() for part in text.split("******"))
    return first != second


def validate_uppercase(text: str) -> bool:
    return text == text.upper()


def validate_lowercase(text: str) -> bool:
    return text == text.lower()


def validate_frequency_capital_words(text: str, N: int, quantifier: str) -> bool:
    return _quantified(len(re.findall(r"\b[A-Z]+\b", text)), N, quantifier, around=0)


def validate_end(text: str, end_phrase: str) -> bool:
    return text.endswith(end_phrase)


def validate_quotation(text: str) -> bool:
    return text.startswith('"') and text.endswith('"')


def validate_no_commas(text: str) -> bool:
    return "," not in text


CHECKS: dict[str, Callable[..., bool]] = {fn.__name__: fn for fn in (
    verify_keywords, verify_keyword_frequency, validate_forbidden_words, verify_letter_frequency,
    validate_response_language, verify_paragraph_count, validate_word_constraint, verify_sentence_constraint,
    validate_paragraphs, verify_postscript, validate_placeholders, verify_bullet_points, validate_title,
    validate_choice, validate_highlighted_sections, validate_sections, validate_json_format,
    validate_repeat_prompt, validate_two_responses, validate_uppercase, validate_lowercase,
    validate_frequency_capital_words, validate_end, validate_quotation, validate_no_commas)}


def parse_constraint(ground_truth: Any) -> tuple[Callable[..., bool], dict[str, Any]]:
    """(the check, its arguments) of a ground truth; a ValueError says what is wrong with it."""
    if isinstance(ground_truth, str):
        try:
            ground_truth = json.loads(ground_truth)
        except ValueError as err:
            raise ValueError(f"the ifeval ground truth is not JSON ({err}): {ground_truth[:80]!r}") from None
    if not isinstance(ground_truth, dict):
        raise ValueError(f"the ifeval ground truth is a {type(ground_truth).__name__}, not a JSON object naming "
                         "func_name and its arguments")
    name = ground_truth.get("func_name")
    if name not in CHECKS:
        raise ValueError(f"func_name={name!r} is not an IF check (known: {', '.join(sorted(CHECKS))})")
    check = CHECKS[name]
    params = inspect.signature(check).parameters
    args = {k: v for k, v in ground_truth.items() if k in params and k != "text"}
    missing = [k for k in params if k != "text" and k not in args]
    if missing:
        raise ValueError(f"func_name={name!r} needs {', '.join(missing)}, which the ground truth does not give")
    if name == "validate_response_language":
        if importlib.util.find_spec("langdetect") is None:
            raise ValueError("validate_response_language needs the langdetect package (pip install langdetect)")
    return check, args


def compute_score(solution_str: str, ground_truth: Any) -> dict[str, float]:
    check, args = parse_constraint(ground_truth)
    held = bool(check(after_last_think(solution_str), **args))
    return {"score": float(held) + repetition_penalty_reward(solution_str, 3, -0.5), "acc": float(held)}
