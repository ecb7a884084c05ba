"""Format check of configs/distill_context.py: 1.0 when the whole response is one number (the
behaviour the teacher's worked examples show), else 0.0; the value itself is not checked."""
import re

_BARE_NUMBER = re.compile(r"\s*-?\d+(?:\.\d+)?\s*")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(_BARE_NUMBER.fullmatch(solution_str) is not None)
