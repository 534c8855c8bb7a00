"""The programs behind both fronts: what `mima fit`, `mima merge` and `mima evaluate` run, called by
the commands (mima/commands/) and by the Python API (mima/api.py) alike."""
