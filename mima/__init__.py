"""mima: multi-task fine-tuning with iterated model averaging, and model merging.

The pieces, by package:
  mima.models     open_clip models, the embedded tiny CLIP, zero-shot classification heads
  mima.data       task registry and suites, splits, the per-task batch schedule
  mima.training   the LightningModule, the MIMA synchronisation callback, `mima fit`
  mima.merging    merge strategies (one module each) and their hyperparameter selection
  mima.evaluation accuracy, the Table-1 style report, plots
"""

__version__ = "0.1.0"
