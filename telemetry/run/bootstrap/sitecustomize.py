"""memtel run's bootstrap: installs the hook in every Python process started with this directory on PYTHONPATH.

At start-up Python's `site` module imports `sitecustomize` from the first directory of sys.path that has
one. `memtel run` puts this directory first on PYTHONPATH, so every Python process of the run comes here
(multiprocessing's spawn and forkserver children and `subprocess` Python children inherit the variable;
forked children inherit the hook itself). Here:
1. this directory leaves this process's sys.path (children still get it from PYTHONPATH);
2. the hook is installed from the environment (telemetry/run/boot.py; never raises);
3. the sitecustomize this file shadows, if any, is found on the remaining path and run, as Python would
   have run it; its errors are its own (site reports them as without memtel).
A Python that cannot import memtel (another interpreter, another venv) says so in one line and runs on.
"""

import os
import sys


def _memtel_run_bootstrap() -> None:
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != here]
    try:
        from telemetry.run import boot
    except Exception as error:
        sys.stderr.write(f"memtel run: no hook in pid {os.getpid()}: {sys.executable} cannot import memtel "
                         f"({error!r}); install memtel into this environment\n")
    else:
        boot.boot()
    _run_shadowed_sitecustomize()


def _run_shadowed_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_memtel_run_bootstrap()
