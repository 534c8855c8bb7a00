"""mima: multi-task fine-tuning with iterated model averaging, and model merging.

The pieces, by package (imports go one way, top to bottom; tests/architecture/test_architecture.py checks it):
  mima.core        state-dict arithmetic, tensor files, atomic writes, truncated SVD, the phase plan,
                   the run-folder contract (RunFolder, SweepFolder), errors; imports nothing above it
  mima.data        task registry and suites, splits, the per-task batch schedule, the datamodule
  mima.models      open_clip models, the embedded models, frozen heads, BatchNorm freezing
  mima.training    the LightningModule, the MIMA synchronisation callback, what a `mima fit` run is built
                   from (strategy, layout, resume, checkpoints)
  mima.merging     merge strategies (one module each), their registry, the streaming engine (core only)
  mima.evaluation  accuracy, the Table-1 style results (numbers, Markdown tables, files), plots
  mima.pools       model pool and task pool for data-dependent merges, selection and analyses
  mima.analysis    why a merge works: one package per analysis (computation, plot, command)
  mima.convert     pickled modules read without running them; transformers CLIP <-> open_clip
  mima.services    the programs behind both fronts, the commands and the Python API: `mima fit`'s (its
                   config parsed, build_trainer, the run), `mima merge`'s, `mima evaluate`'s
  mima.commands    one module or package per command (its options, parse and main, and what only the
                   command line runs: the sweep, the demo, the report) and the COMMANDS table; only
                   the command line imports it
  mima.cli         the command line: parses and dispatches through that table
  mima.api         the commands as Python functions for notebooks (docs/api.md): mima.fit, mima.plan,
                   mima.merge, mima.evaluate, mima.load_results, mima.MimaError, loaded on first use;
                   a front beside the commands over mima.services (it imports nothing from them)
"""

import os

__version__ = "0.1.0"

# OpenMP threads that wait for work sleep instead of spinning. A spinning thread holds its core, so on a
# machine busier than its cores (several mima processes, other jobs) each parallel step waits for a
# thread the scheduler has parked: a 2-thread step ran 6.5x slower at load 9 on 2 cores (10 steps of
# the embedded pretraining: 41.3 s spinning, 6.4 s passive); the results are the same bits. Read by
# libgomp when torch is loaded, so set here, before any import of torch; a value the user set stays.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The Python API (mima.api), loaded when one of its names is first used: `import mima` and the
# command line stay free of torch.
_API_NAMES = ("MimaError", "evaluate", "fit", "load_results", "merge", "plan")

__all__ = ["__version__", *_API_NAMES]


def __getattr__(name: str) -> object:
    if name in _API_NAMES:
        import importlib

        return getattr(importlib.import_module("mima.api"), name)
    raise AttributeError(f"module 'mima' has no attribute {name!r}")
