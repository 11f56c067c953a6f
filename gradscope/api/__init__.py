"""What notebooks call: each command as a function on a model and data as Python holds them
(``scoring.py``, ``commands.py``), run on a config as the command line runs (``configured.py``);
and the scores of one batch of tensors (``batch.py``)."""

from .batch import per_example_influence, per_example_norms
from .commands import check, factors, train, validate, write_report
from .scoring import build_index, influence, norms, query, references_by_examples

__all__ = [
    "check",
    "factors",
    "build_index",
    "influence",
    "norms",
    "per_example_influence",
    "per_example_norms",
    "query",
    "references_by_examples",
    "write_report",
    "train",
    "validate",
]
