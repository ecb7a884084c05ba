"""Errors shared across packages (a leaf module: it imports nothing of ours)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad config: one message that names the offending key."""
