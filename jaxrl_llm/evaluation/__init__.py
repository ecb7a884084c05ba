"""Offline generation and evaluation around RL: a prompt file -> n responses per row (generate.py, veRL's
main_generation, resumable), a responses file -> mean@n / pass@k / best@k per data source with the
built-in or a custom scorer (evaluate.py + metrics.py, veRL's main_eval)."""
from jaxrl_llm.evaluation.evaluate import evaluate_file, score_rows
from jaxrl_llm.evaluation.generate import BatchGenerator, generation_view
from jaxrl_llm.evaluation.metrics import best_at_k, pass_at_k, summarize, table

__all__ = ["BatchGenerator", "best_at_k", "evaluate_file", "generation_view", "pass_at_k", "score_rows", "summarize",
           "table"]
