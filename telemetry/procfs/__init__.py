"""Pure parsers for /proc files, shared by the hook and the daemon."""
