"""The directory memtel run puts first on PYTHONPATH: it holds only `sitecustomize.py` (see there)."""
