"""The web dashboard the gateway serves at /ui: fleet, clusters and events, live from the event
stream (routes.py; docs/dashboard.md)."""

from .routes import PREFIX, mount, ui_app
from .session import Sessions

__all__ = ["PREFIX", "Sessions", "mount", "ui_app"]
