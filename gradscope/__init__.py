"""gradscope: exact per-example gradient norms and influence for PyTorch models."""

__version__ = "0.1.0"

API = (
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
)
__all__ = ["__version__", *API]


def __getattr__(name: str):
    """The API on first use: ``python -m gradscope`` starts without importing torch here, so
    Ctrl-C while torch loads is still the command line's to report."""
    if name in API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'gradscope' has no attribute {name!r}")
