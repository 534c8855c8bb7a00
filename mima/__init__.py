"""mima: multi-task fine-tuning with iterated model averaging, and model merging.

The pieces, by package (imports go one way, top to bottom; tests/test_architecture.py checks it):
  mima.core        state-dict arithmetic, tensor files, atomic writes, truncated SVD, the phase plan,
                   the run-folder contract (RunFolder, SweepFolder), errors; imports nothing above it
  mima.data        task registry and suites, splits, the per-task batch schedule, the datamodule
  mima.models      open_clip models, the embedded models, frozen heads, BatchNorm freezing
  mima.training    the LightningModule, the MIMA synchronisation callback, `mima fit`, the run config
  mima.merging     merge strategies (one module each), their registry, the streaming engine (core only)
  mima.evaluation  accuracy, the Table-1 style results (numbers, Markdown tables, files), plots
  mima.pools       model pool and task pool for data-dependent merges, selection and analyses
  mima.analysis    why a merge works: one package per analysis (computation, plot, command)
  mima.convert     pickled modules read without running them; transformers CLIP <-> open_clip
  mima.commands    one module or package per command (its options, parse, main and what it runs:
                   the sweep, the evaluation of runs, the demo, the report, merges of files) and the
                   COMMANDS table
  mima.cli         the command line: parses and dispatches through that table
  mima.api         the commands as Python functions for notebooks (docs/api.md): mima.fit, mima.plan,
                   mima.merge, mima.evaluate, mima.load_results, mima.MimaError, loaded on first use
"""

__version__ = "0.1.0"

# The Python API (mima.api), loaded when one of its names is first used: `import mima` and the
# command line stay free of torch.
_API_NAMES = ("MimaError", "evaluate", "fit", "load_results", "merge", "plan")

__all__ = ["__version__", *_API_NAMES]


def __getattr__(name: str) -> object:
    if name in _API_NAMES:
        import importlib

        return getattr(importlib.import_module("mima.api"), name)
    raise AttributeError(f"module 'mima' has no attribute {name!r}")
