"""The memory plan and the roofline: before any weight loads, every program of a step is traced and
compiled for the run's mesh (or a TPU topology), its bytes per device compared with the device's
memory, `auto` micro-batch sizes resolved and memory levers pulled (`memory.py`, `programs.py`,
`levers.py`, `longest.py`); `roofline.py` estimates each program's time from its compiled FLOPs and
bytes; `preflight.py` the checks that run on the tokenizer and data before the plan.
"""
