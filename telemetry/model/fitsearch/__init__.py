"""`memtel tune`'s search: the settings under which the longest prefill fits, on the allocator simulator.

space.py: the settings searched and their checks; search.py: the search and its ranking; verify.py: each
top setting run again in a fresh process (the simulator here, CUDA on a GPU machine); rebuild.py: an allocator
state from a snapshot rebuilt on a real allocator. The command line is telemetry/tune/cli.py (it reads the
node's headroom and the engine presets, which sit above this floor).
"""
