"""open-r1's reward functions by name (jaxrl_llm/rewards/named.py) against open-r1's formulas
(src/open_r1/rewards.py), worked by hand on fixed responses, and their weighted sum in the reward
manager."""
import json
import math

import numpy as np
import pytest

from jaxrl_llm.rewards import named
from jaxrl_llm.rewards.managers import RewardManager
from jaxrl_llm.rewards.named import NamedRewards, named_scores

GOOD = "<think>\nadd them\n</think>\n<answer>\n42\n</answer>"
DEFAULTS = NamedRewards(("accuracy",), (1.0,))  # open-r1's GRPOScriptArguments defaults


def test_format_and_tag_count():
    assert named.format_reward(GOOD) == 1.0
    # open-r1 matches with MULTILINE: `$` holds at any line end, so more lines may follow </answer>; more
    # text on its line may not
    assert named.format_reward(GOOD + "\nmore") == 1.0 and named.format_reward(GOOD + " more") == 0.0
    assert named.format_reward("<think>add them</think><answer>42</answer>") == 0.0
    assert named.tag_count_reward(GOOD) == 1.0
    assert named.tag_count_reward("<think>\nno end") == 0.25
    # "<think>\n" twice earns nothing for that tag; the other three are found once
    assert named.tag_count_reward("<think>\n<think>\nx\n</think>\n<answer>\n1\n</answer>") == 0.75


def test_reasoning_steps_counts_open_r1s_markers():
    assert named.reasoning_steps_reward("Step 1: a\nStep 2: b") == pytest.approx(2 / 3)
    assert named.reasoning_steps_reward("First, a. Second, b. Next, c. Finally, d.") == 1.0
    # no MULTILINE in open-r1's findall: "^\d+\." matches at the very start only; "\n-" / "\n*" anywhere
    assert named.reasoning_steps_reward("1. a\n2. b") == pytest.approx(1 / 3)
    assert named.reasoning_steps_reward("x\n- a\n* b") == pytest.approx(2 / 3)
    assert named.reasoning_steps_reward("just an answer") == 0.0


def test_cosine_scales_by_length_and_correctness():
    p = DEFAULTS  # wrong: min 0.0, max -0.5; correct: min 0.5, max 1.0; max_len 1000
    assert named.cosine_reward("", True, p) == pytest.approx(1.0)
    assert named.cosine_reward("x" * 1000, True, p) == pytest.approx(0.5)
    assert named.cosine_reward("x" * 500, True, p) == pytest.approx(0.5 + 0.25 * (1 + math.cos(math.pi / 2)))
    # wrong answers swap the ends: -0.5 + 0.25 (1 + cos(pi L / 1000))
    assert named.cosine_reward("", False, p) == pytest.approx(0.0)
    assert named.cosine_reward("x" * 1000, False, p) == pytest.approx(-0.5)
    assert named.cosine_reward("x" * 250, False, p) == pytest.approx(-0.5 + 0.25 * (1 + math.cos(math.pi / 4)))


def test_repetition_penalty():
    # "a b c a b c": 4 word trigrams, 3 distinct -> (1 - 3/4) x -1
    assert named.repetition_penalty_reward("A b c a B c", 3, -1.0) == pytest.approx(-0.25)
    assert named.repetition_penalty_reward("one two three four", 3, -1.0) == 0.0
    assert named.repetition_penalty_reward("one two", 3, -1.0) == 0.0
    assert named.repetition_penalty_reward("", 3, -1.0) == 0.0
    with pytest.raises(ValueError, match="must not be positive"):
        NamedRewards(("repetition_penalty",), (1.0,), repetition_max_penalty=0.5)


def test_length_is_kimis_over_the_step():
    texts = ["x" * 10, "x" * 20, "x" * 30, "x" * 30]
    correct = np.array([True, False, True, False])
    # lambda = 0.5 - (L - 10) / 20 = [0.5, 0, -0.5, -0.5]; wrong answers: min(0, lambda)
    np.testing.assert_allclose(named.length_rewards(texts, correct), [0.5, 0.0, -0.5, -0.5])
    np.testing.assert_allclose(named.length_rewards(["ab", "cd"], np.array([True, False])), [0.0, 0.0])


def test_code_rewards_run_the_rows_tests_in_the_sandbox(monkeypatch):
    info = {"language": "python", "test_cases": [{"input": "1 2\n", "output": "3\n", "type": "stdin_stdout"},
                                                 {"input": "5 5\n", "output": "10\n", "type": "stdin_stdout"}]}
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    half = "```python\na, b = map(int, input().split())\nprint(3)\n```"
    assert named.code_reward(right, json.dumps(info)) == 1.0 and named.code_reward(half, info) == 0.5
    runs = []
    sandbox = named.code_reward
    monkeypatch.setattr(named, "code_reward", lambda t, g: runs.append(t) or sandbox(t, g))
    p = NamedRewards(("code", "binary_code", "code_format"), (1.0, 1.0, 1.0))
    formatted = f"<think>\nsum\n</think>\n<answer>\n{right}\n</answer>"
    total, each, errors = named_scores(p, [formatted, half, "no code"], np.zeros(3), [info, info, {"x": 1}])
    np.testing.assert_allclose(each["code"], [1.0, 0.5, 0.0])
    np.testing.assert_allclose(each["binary_code"], [1.0, 0.0, 0.0])
    np.testing.assert_allclose(each["code_format"], [1.0, 0.0, 0.0])
    np.testing.assert_allclose(total, [3.0, 0.5, 0.0])
    assert len(errors) == 2 and all("ValueError" in e for e in errors)  # the row without test cases, twice
    assert len(runs) == 4  # code and binary_code share each row's run (the failed one is tried by each)


def test_manager_sums_the_weighted_functions_and_logs_each():
    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 if solution_str.endswith(f"{ground_truth}\n</answer>") else 0.0

    p = NamedRewards(("accuracy", "format", "tag_count", "cosine"), (1.0, 0.5, 0.25, 2.0))
    manager = RewardManager(scorer, named=p)
    responses = [GOOD, "<think>\nhmm\n</think>\n<answer>\n7\n</answer>", "42"]
    result = manager.score(responses, ["s"] * 3, ["42", "42", "42"])
    acc, fmt = np.array([1.0, 0.0, 0.0]), np.array([1.0, 1.0, 0.0])
    tags = np.array([1.0, 1.0, 0.0])
    cos = np.array([named.cosine_reward(r, bool(a), p) for r, a in zip(responses, acc)])
    np.testing.assert_allclose(result.scores, acc + 0.5 * fmt + 0.25 * tags + 2.0 * cos, rtol=1e-6)
    np.testing.assert_allclose(result.reward_extra_info["score"], acc)
    np.testing.assert_allclose(result.reward_extra_info["format_reward"], fmt)
    assert result.metrics["reward/tag_count/mean"] == pytest.approx(2 / 3)
    assert result.metrics["reward/cosine/mean"] == pytest.approx(cos.mean())

    # without accuracy, cosine or length the row's scorer is not called: an unknown data_source is no error
    def unknown(**kwargs):
        raise AssertionError("called")

    only_format = RewardManager(unknown, named=NamedRewards(("format",), (2.0,)))
    np.testing.assert_allclose(only_format.score(responses, ["nowhere"] * 3, [None] * 3).scores, 2.0 * fmt)
