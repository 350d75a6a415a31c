"""`memtel tune`'s command line (cli.py) and the engines it writes settings for (engines.py); the search itself is
telemetry/model/tune. It sits on the commands' floor because it reads the node's headroom and the hook's presets."""
