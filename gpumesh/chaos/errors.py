"""What `gpumesh chaos` raises when a run cannot start."""

from __future__ import annotations


class ChaosError(Exception):
    """A run that cannot start (no gateway, no controller answers), or a fault that cannot be
    applied (up's control socket refuses a cut): one line."""
