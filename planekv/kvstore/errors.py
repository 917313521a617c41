"""Typed errors of the core library; services map them to HTTP status codes."""

from __future__ import annotations


class PlaneKVError(Exception):
    """Base class of every PlaneKV error."""


class FormatMismatch(PlaneKVError):
    """Data of one format was opened or read under another (format ids differ)."""


class CalibrationError(PlaneKVError):
    """A calibration artifact is missing, malformed, of an unknown version or of other geometry."""


class BudgetError(PlaneKVError, ValueError):
    """A read budget cannot be met (negative, below the minimum depths, or ill-formed)."""


class CacheFull(PlaneKVError):
    """The page pool has no free page for an append."""
