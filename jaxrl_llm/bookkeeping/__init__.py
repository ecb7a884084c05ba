"""A run's bookkeeping, independent of the RL algorithm: metric sinks and the run record
(`tracking.py`), the metric helpers and FLOP counts (`metrics.py`), plots (`plot.py`), SIGTERM
handling (`preemption.py`) and the non-finite guard (`nonfinite.py`).
"""
