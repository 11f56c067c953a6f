"""Layer rules, one module per family; importing this package registers them all."""

from . import (
    attention,
    conv,
    embedding,
    embedding_bag,
    hf_conv1d,
    library_norm,
    linear,
    norm,
    recurrent,
)
from .base import Contribution, Dense
from .embedding import Rows
from .outer import Outer
from .registry import MATCHERS, NAMED, RULES, Rule, find_rule, register_rule

__all__ = [
    "MATCHERS",
    "NAMED",
    "RULES",
    "Contribution",
    "Dense",
    "Outer",
    "Rows",
    "Rule",
    "find_rule",
    "register_rule",
    "attention",
    "conv",
    "embedding",
    "embedding_bag",
    "hf_conv1d",
    "library_norm",
    "linear",
    "norm",
    "recurrent",
]
