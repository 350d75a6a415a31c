"""`memtel run`: the hook in any Python program and in every Python process it starts (docs/hook.md).

Modules: cli (the subcommand: checks the input, sets the environment, execs the command), bootstrap/
(the `sitecustomize.py` that memtel run puts first on the children's PYTHONPATH), boot (what that file
runs in each Python process: the hook from the environment), order (the run's private directory and
its counter: each process's order, the rank where nothing else names one).
"""
