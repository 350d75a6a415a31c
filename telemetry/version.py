"""memtel's version, in a module of its own: the daemon reads it without importing the package's `__init__`,
whose `install` reaches the hook (the daemon never imports the hook: pyproject.toml's forbidden contract)."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
