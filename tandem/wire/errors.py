"""One exception type per failure kind. The router maps them to gRPC status codes once, at its edge."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent."""
