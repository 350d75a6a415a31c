"""`memtel tune`'s command line (cli.py) and the engines it writes settings for (engines.py); the search itself is
telemetry/model/fitsearch. It sits on the commands' floor because it reads the node's headroom; it never imports
the hook (a forbidden contract in pyproject.toml)."""
