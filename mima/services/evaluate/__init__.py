"""`mima evaluate`'s program: finished runs merged and evaluated into the Table-1 results, one module
per job (mima.services.evaluate.runs composes them); run by the command (mima.commands.evaluate) and
by the Python API (mima.api.evaluate)."""
