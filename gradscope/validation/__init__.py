"""Attribution checked by retraining: the linear datamodeling score (LDS), the removal test and
detection AUROC of score files, against a ground truth of retrained models kept in a file."""

from .metrics import auroc, ranks, spearman, summarize
from .scores import ScoreFile, read_scores
from .truth import Model, Task, Truth, read_truth
from .validate import Options, validate

__all__ = [
    "Model",
    "Options",
    "ScoreFile",
    "Task",
    "Truth",
    "auroc",
    "ranks",
    "read_scores",
    "read_truth",
    "spearman",
    "summarize",
    "validate",
]
