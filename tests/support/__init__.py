"""Helpers shared by tests: real servers, tiny models, free ports."""
