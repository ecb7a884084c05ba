"""Fixtures for the HF tests (model builders and batch helpers live in `tests/tiny_models.py`)."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def np_rng():
    return np.random.default_rng(0)
