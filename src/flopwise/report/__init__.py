"""``flopwise report``: a self-contained HTML page (and PNG figures) of one or several runs."""

from flopwise.report.report import build_report
from flopwise.report.runs import ReportError

__all__ = ["build_report", "ReportError"]
