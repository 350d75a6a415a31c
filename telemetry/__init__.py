"""memtel telemetry: the in-process allocator hook and the node daemon.

Importing this package is cheap and never imports torch.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "install"]


def install(targets, **options):
    """Hook ``targets`` ("package.module:function" or "package.module:Class.method").

    Returns a handle whose ``uninstall()`` restores the original objects. See telemetry.hook.
    """
    from telemetry.hook import install as _install

    return _install(targets, **options)
