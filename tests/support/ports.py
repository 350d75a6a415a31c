"""Free loopback ports for tests that start real servers: the product's own helper (harness/ports.py), which
takes them from outside the kernel's ephemeral range and never hands one out twice in a process."""

from harness.ports import free_port, free_port_block

__all__ = ["free_port", "free_port_block"]
