"""Built-in scorers give veRL's scores for the same strings (cases traced through veRL's rules)."""
import pytest

from jaxrl_llm.rewards import UnknownDataSourceError, default_compute_score
from jaxrl_llm.rewards.scorers import gsm8k, math_boxed, math_dapo


@pytest.mark.parametrize("response,truth,want", [
    ("3 + 4 = 7 apples. #### 72", "72", 1.0),          # correct
    ("#### 71", "72", 0.0),                             # wrong: format score 0
    ("The answer is 72", "72", 0.0),                    # malformed: no ####
    ("####72", "72", 0.0),                              # malformed: no space
    ("#### 5 no wait #### 72", "72", 1.0),              # several candidates: the last counts
    ("#### 72 no wait #### 5", "72", 0.0),
    ("#### 1,234", "1234", 1.0),                        # commas removed
    ("#### -3", "-3", 1.0),
    ("#### 72.", "72", 0.0),                            # veRL keeps the trailing dot
    # the raw openai/gsm8k `answer` column as ground truth (data.ground_truth_key): its final number counts
    ("#### 1234", "Janet sells 16 - 3 = <<16-3=13>>13 eggs.\n#### 1,234", 1.0),
    ("#### 13", "Janet sells 16 - 3 = <<16-3=13>>13 eggs.\n#### 1,234", 0.0),
])
def test_gsm8k(response, truth, want):
    assert default_compute_score("openai/gsm8k", response, truth) == want


def test_gsm8k_flexible():
    assert gsm8k.extract_answer("so 3, then 72", "flexible") == "72"
    assert gsm8k.extract_answer("no digits here", "flexible") is None


@pytest.mark.parametrize("source", ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"])
@pytest.mark.parametrize("response,truth,want", [
    ("so $\\boxed{\\frac{1}{2}}$", "\\frac12", 1.0),     # \frac12 -> \frac{1}{2}
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{10\\%}", "10", 1.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    ("The answer is $\\boxed 5$.", "5", 1.0),
    ("\\boxed{3} or maybe \\boxed{4}", "4", 1.0),        # several candidates: the last box
    ("\\boxed{3} or maybe \\boxed{4}", "3", 0.0),
    ("\\boxed{6}", "5", 0.0),                            # wrong
    ("the answer is 5", "5", 0.0),                       # malformed: no box
    ("\\boxed{5", "5", 0.0),                             # unbalanced
    ("\\fbox{5}", "5", 0.0),                             # veRL finds \fbox but cannot unbox it
])
def test_math_boxed(source, response, truth, want):
    assert default_compute_score(source, response, truth) == want


def test_math_normalisation_details():
    assert math_boxed.normalise(" .5") == "\\frac{1}{2}"
    assert math_boxed.normalise("\\sqrt3") == "\\sqrt{3}"
    assert math_boxed.normalise("5\\text{ cm}") == "5"
    # an empty \frac argument: veRL's normaliser raises, so the strings are compared verbatim
    assert math_boxed.is_equiv("1\\frac", "1\\frac") and not math_boxed.is_equiv("1\\frac", "1 \\frac")


@pytest.mark.parametrize("source", ["math_dapo", "math", "aime2024", "aime_2025"])
@pytest.mark.parametrize("response,truth,score,pred", [
    ("work...\nAnswer: 42", "42", 1.0, "42"),
    ("Answer: 41", "42", -1.0, "41"),
    ("answer : $\\frac{1}{2}$", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),
    ("Answer: 3\nAnswer: 5", "5", 1.0, "5"),                  # last Answer: line
    ("Answer: 1,000 dollars", "1000", 1.0, "1000"),
    ("no marker but \\boxed{7}", "7", -1.0, "[INVALID]"),     # veRL: no Answer: line, no fallback
    ("no answer at all", "7", -1.0, "[INVALID]"),             # malformed
    ("Answer: 5" + "x" * 400, "5", -1.0, "[INVALID]"),         # only the last 300 characters count
])
def test_math_dapo(source, response, truth, score, pred):
    result = default_compute_score(source, response, truth)
    assert result == {"score": score, "acc": score > 0, "pred": pred}


def test_math_dapo_strict_box():
    assert math_dapo.compute_score("\\boxed{7}", "7", strict_box_verify=True)["score"] == 1.0
    assert math_dapo.compute_score("Answer: 7", "7", strict_box_verify=True) == {
        "score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert math_dapo.compute_score("\\boxed{1,000}", "1000", strict_box_verify=True)["score"] == -1.0  # unnormalised
    assert default_compute_score("math_dapo", "\\boxed{7}", "7", strict_box_verify=True)["score"] == 1.0


@pytest.mark.parametrize("response,truth,score,pred", [
    ("no marker but \\boxed{7}", "7", 1.0, "7"),
    ("\\boxed{1,000 dollars}", "1000", 1.0, "1000"),
    ("Answer: 6\nthen \\boxed{7}", "7", -1.0, "6"),  # an Answer: line still wins
    ("\\boxed{7}" + "x" * 120, "7", -1.0, "[INVALID]"),  # the box must be in the final 100 characters
])
def test_math_dapo_lenient_is_opt_in(response, truth, score, pred):
    assert default_compute_score("math_dapo", response, truth, lenient=True) == {
        "score": score, "acc": score > 0, "pred": pred}
    assert default_compute_score("math_dapo", response, truth)["score"] == (-1.0 if "Answer" not in response
                                                                             else score)


def test_math_dapo_numeric_ground_truth():
    assert default_compute_score("aime2024", "Answer: 42", 42)["score"] == 1.0


@pytest.mark.parametrize("response,truth,fmt,want", [
    ("7", "7", "strict", 1.0),
    (" 7\n", "7", "strict", 1.0),
    ("The answer is 7", "7", "strict", 0.0),
    ("The answer is 7", "7", "lenient", 1.0),
    ("3 + 4 = 7", "7", "lenient", 1.0),          # several numbers: the last counts
    ("7, no, 8", "7", "lenient", 0.0),
    ("seven", "7", "lenient", 0.0),
    ("apple river", "apple river", "strict", 1.0),
    ("Sure: Apple  River!", "apple river", "lenient", 1.0),
    ("pineapple river", "apple river", "lenient", 0.0),
    ("apple", "apple river", "lenient", 0.0),
])
def test_synthetic(response, truth, fmt, want):
    assert default_compute_score("synthetic/add", response, truth, {"answer_format": fmt}) == want


@pytest.mark.parametrize("response,want", [
    ("13", 1.0), ("The answer is 13.", 1.0), ("6 + 7 = 13", 0.0), ("To solve this, add them", 0.0)])
def test_synthetic_first_number(response, want):
    assert default_compute_score("synthetic/add", response, "13", {"answer_format": "first"}) == want
    assert default_compute_score("synthetic/repeat", "Apple river!", "apple river", {"answer_format": "first"}) == 1.0


def test_synthetic_default_is_strict_and_unknown_source():
    assert default_compute_score("synthetic/repeat", "x y", "x y") == 1.0
    assert default_compute_score("synthetic/repeat", "x y z", "x y") == 0.0
    with pytest.raises(UnknownDataSourceError, match="data_source='my/data'.*custom_reward_function.path"):
        default_compute_score("my/data", "x", "y")
