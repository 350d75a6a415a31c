"""Free loopback ports for tests that start real servers (the product's own helper)."""

from harness.ports import free_port, free_port_block

__all__ = ["free_port", "free_port_block"]
