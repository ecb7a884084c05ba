"""ROLL's rule rewards as built-in scorers: crossthinkqa (its CrossThinkQARuleRewardWorker) and ifeval (its
GeneralRuleRewardWorker: open-instruct's IF checks), on fixed responses with the numbers ROLL's code gives."""
import json

import pytest

from jaxrl_llm.rewards.scorers import default_compute_score, ground_truth_problem, has_builtin_scorer
from jaxrl_llm.rewards.scorers.ifeval import CHECKS
from jaxrl_llm.rewards.scorers.text import repetition_penalty_reward


@pytest.mark.parametrize("response,truth,reward_type,want,acc", [
    ("<think>maybe A</think>\n\nThe answer is \\boxed{B}", "B", "soft", 1.0, 1.0),  # boxed, right
    ("The answer is (B) because", "B", "soft", 0.5, 1.0),  # right, not boxed: soft gives half
    ("The answer is (B) because", "B", "strict", -1.0, 0.0),
    ("The answer is (B) because", "B", "loose", 1.0, 1.0),
    ("\\boxed{C}", "B", "soft", -0.5, 0.0),  # boxed, wrong
    ("no letter here", "B", "soft", -1.0, 0.0),
    ("<think>\\boxed{B}</think>so the answer is c) or D", "B", "soft", -1.0, 0.0),  # after </think>: 'D'
    ("i think B. The answer is: E", "E", "soft", 0.5, 1.0),  # the text after the last "answer is"
])
def test_crossthinkqa_rewards_as_roll(response, truth, reward_type, want, acc):
    out = default_compute_score("crossthinkqa", response, truth, reward_type=reward_type)
    assert out["score"] == pytest.approx(want) and out["acc"] == acc


def test_crossthinkqa_adds_rolls_repetition_penalty():
    response = "a b c a b c a b c \\boxed{A}"
    # 3-grams of the whole response: 8, distinct 4 -> (1 - 4/8) * -0.5 = -0.25
    assert repetition_penalty_reward(response, 3, -0.5) == pytest.approx(-0.25)
    assert default_compute_score("crossthinkqa", response, "A")["score"] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="reward_type='exact'"):
        default_compute_score("crossthinkqa", "A", "A", reward_type="exact")


def _gt(name, **args):
    return json.dumps({"func_name": name, **args})


@pytest.mark.parametrize("gt,response,held", [
    (_gt("verify_keywords", keyword_list=["Apple", "pie"]), "I like apple PIE", True),
    (_gt("verify_keywords", keyword_list=["Apple", "cake"]), "I like apple PIE", False),
    (_gt("verify_keyword_frequency", word="cat", N=2), "Cat and cat and dog", True),
    (_gt("verify_keyword_frequency", word="cat", N=5), "Cat and cat and dog", False),  # ROLL's copy: 5 words
    (_gt("validate_forbidden_words", forbidden_words=["bad"]), "all good", True),
    (_gt("verify_letter_frequency", letter="a", N=3), "banana", True),
    (_gt("verify_paragraph_count", N=2), "one\n* * *\ntwo", True),
    (_gt("verify_paragraph_count", N=3), "one\n* * *\n* * *\ntwo", False),  # an empty paragraph
    (_gt("validate_word_constraint", N=10, quantifier="around"), " ".join(["w"] * 11), True),
    (_gt("validate_word_constraint", N=10, quantifier="at most"), " ".join(["w"] * 11), False),
    (_gt("verify_sentence_constraint", N=3, quantifier="at least"), "One. Two? Three.", True),
    (_gt("validate_paragraphs", N=2, first_word="Next", i=2), "First part\n\nNext part", True),
    (_gt("verify_postscript", postscript_marker="P.S."), "Body\nP.S. more", True),
    (_gt("verify_postscript", postscript_marker="P.S."), "Body\nP.S.", False),
    (_gt("validate_placeholders", N=2), "[name] at [address]", True),
    (_gt("verify_bullet_points", N=2), "* one\n- two\nthree", True),
    (_gt("validate_title"), "<<A title>> text", True),
    (_gt("validate_choice", options=["My answer is yes.", "My answer is no."]), "My answer is no.", True),
    (_gt("validate_highlighted_sections", N=2), "*one* and *two*", True),
    (_gt("validate_sections", N=2, section_splitter="SECTION"), "SECTION 1 a SECTION 2 b", True),
    (_gt("validate_json_format"), '{"a": 1}', True),
    (_gt("validate_json_format"), "{a: 1}", False),
    (_gt("validate_repeat_prompt", original_prompt="Say hi."), "Say hi. Hi!", True),
    (_gt("validate_two_responses"), "one ****** two", True),
    (_gt("validate_two_responses"), "same ****** same", False),
    (_gt("validate_uppercase"), "ALL CAPS 1", True),
    (_gt("validate_lowercase"), "all lower", True),
    (_gt("validate_frequency_capital_words", N=2, quantifier="at least"), "THE BIG dog", True),
    (_gt("validate_end", end_phrase="Any questions?"), "Done. Any questions?", True),
    (_gt("validate_quotation"), '"quoted"', True),
    (_gt("validate_no_commas"), "a, b", False),
])
def test_ifeval_checks(gt, response, held):
    out = default_compute_score("ifeval", "<think>thinking, at length</think>\n\n" + response, gt)
    assert out["acc"] == float(held)
    assert out["score"] == pytest.approx(float(held) + repetition_penalty_reward(
        "<think>thinking, at length</think>\n\n" + response, 3, -0.5))


def test_ifeval_covers_rolls_functions_and_checks_ground_truths_when_loading():
    assert len(CHECKS) == 25 and has_builtin_scorer("ifeval") and has_builtin_scorer("crossthinkqa")
    assert ground_truth_problem("ifeval", _gt("validate_end", end_phrase="x")) is None
    assert ground_truth_problem("ifeval", {"func_name": "validate_title"}) is None  # a dict as it is
    assert "not JSON" in ground_truth_problem("ifeval", "validate_title")
    assert "is not an IF check" in ground_truth_problem("ifeval", _gt("validate_poem"))
    assert "needs quantifier" in ground_truth_problem("ifeval", _gt("validate_word_constraint", N=3))


def test_ifeval_language_check_names_its_package_when_absent(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "langdetect" else real(name, *a))
    assert "needs the langdetect package" in ground_truth_problem(
        "ifeval", _gt("validate_response_language", language="en"))


ADD = "```python\ndef add(a, b):\n    return a + b\n```"
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
ECHO = "```python\nprint(sum(map(int, input().split())))\n```"


@pytest.mark.parametrize("row,response,want", [
    # KodCode's pytest rows: each test_* function is called after the program (ROLL's runner)
    ({"case_type": "pytest", "test_cases": [{"assert_code": "def test_add():\n    assert add(1, 2) == 3\n\n"
                                                            "def test_neg():\n    assert add(-1, 1) == 0\n"}]},
     ADD, 1.0),
    ({"case_type": "pytest", "test_cases": json.dumps([{"assert_code": "def test_add():\n    assert add(1, 2) == 3"}])},
     WRONG, 0.0),
    ({"case_type": "assert", "test_cases": ["assert add(2, 2) == 4", {"assert_code": "assert add(0, 5) == 5"}]},
     ADD, 1.0),
    # all or nothing (ROLL's reward): one failing case of two scores 0, not 0.5
    ({"case_type": "assert", "test_cases": ["assert add(2, 2) == 4", "assert add(2, 2) == 5"]}, ADD, 0.0),
    # HumanEval's check(candidate), its import prefix before the program, one run per line after the first
    ({"case_type": "check_based", "test_cases": [{"assert_code": "def check(candidate):\n"
                                                                 "    assert candidate(1, 2) == 3\n"
                                                                 "    assert candidate(5, 5) == 10",
                                                  "entry_point": "add", "import_prefix": "import math\n"}]},
     ADD, 1.0),
    ({"case_type": "input", "test_cases": [{"stdin": "1 2\n", "expected_stdout": "3\n"},
                                           {"stdin": "4 5\n", "expected_stdout": "9"}]}, ECHO, 1.0),
])
def test_roll_code_rows_score_as_rolls_local_sandbox(row, response, want):
    assert ground_truth_problem("code", {**row, "test_case_function": None}) is None
    assert default_compute_score("code", "<think>let me write it</think>\n" + response,
                                 {**row, "test_case_function": None}) == want


def test_roll_code_rows_that_cannot_run_are_named_when_loading():
    assert "case_type 'text'" in ground_truth_problem("code", {"case_type": "text", "test_cases": ["x"]})
    assert "non-empty list" in ground_truth_problem("code", {"case_type": "assert", "test_cases": []})
    assert "stdin / expected_stdout" in ground_truth_problem("code", {"case_type": "input", "test_cases": [{"in": 1}]})
