"""The store: :class:`JobStore` (compare-and-set on the jobs table), fence marks, and the
ownership history recorded in the same transactions."""

from __future__ import annotations

from .jobstore import JobStore

__all__ = ["JobStore"]
