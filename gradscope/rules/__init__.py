"""Layer rules, one module per family; importing this package registers them all."""

from . import conv, embedding, linear, norm
from .base import RULES, Contribution, Dense, Outer, Rule, find_rule, register_rule
from .embedding import Rows

__all__ = [
    "RULES",
    "Contribution",
    "Dense",
    "Outer",
    "Rows",
    "Rule",
    "find_rule",
    "register_rule",
    "conv",
    "embedding",
    "linear",
    "norm",
]
