"""Layer rules, one module per family; importing this package registers them all."""

from . import linear
from .base import RULES, Contribution, Dense, Outer, Rule, find_rule, register_rule

__all__ = [
    "RULES",
    "Contribution",
    "Dense",
    "Outer",
    "Rule",
    "find_rule",
    "register_rule",
    "linear",
]
