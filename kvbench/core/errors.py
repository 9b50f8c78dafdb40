"""Errors every floor may raise about an engine, defined below all of them."""

from __future__ import annotations


class EngineUnavailable(RuntimeError):
    """The engine cannot be had: not installed, or nothing answers where it should. The message says how
    to get one."""
