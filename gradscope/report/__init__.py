"""The HTML report: one self-contained page of charts and the top-k examples shown."""

from .page import write_report

__all__ = ["write_report"]
