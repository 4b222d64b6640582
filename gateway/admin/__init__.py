"""The admin listener: a separate port with its own key, a JSON API and a live status page."""

from .app import AdminApp
from .reload import ReloadRefused, split
from .server import RunningServer, start_server
from .stats import LiveStats

__all__ = ["AdminApp", "LiveStats", "ReloadRefused", "RunningServer", "split", "start_server"]
