"""The HTML report: one self-contained page of charts and the top-k examples shown."""

from .page import check_report, write_report

__all__ = ["check_report", "write_report"]
