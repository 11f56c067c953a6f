"""gradscope: exact per-example gradient norms and influence for PyTorch models."""

__version__ = "0.1.0"

from .api import per_example_influence, per_example_norms  # noqa: E402

__all__ = ["__version__", "per_example_influence", "per_example_norms"]
