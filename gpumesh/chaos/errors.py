"""What `gpumesh chaos` raises when a run cannot start."""

from __future__ import annotations


class ChaosError(Exception):
    """A run that cannot start (no gateway, no controller answers): one line."""
