"""Analyses of fine-tuned and merged models: why a merge works (papers 000, 001, 003, 004).

Each analysis is a package of three modules:
  compute.py  the computation: importable functions that return numbers (no files written, no
              matplotlib, no argument parsing, no printing);
  plot.py     its figures (matplotlib only, through mima.analysis.figures);
  command.py  its `mima analyze NAME` subcommand: `add_arguments(parser)` / `main(options)` parse the
              options, load models and tasks (mima.pools, mima.config.run_config, RunFolder), write
              the JSON and the PNGs and print a summary.
The command line finds the commands through ANALYSES; outputs go to `--out`, by default the run
folder's analysis folder for NAME (RunFolder.analysis_dir), which `mima report` picks up.
"""

# subcommand -> (module, one-line description)
ANALYSES: dict[str, tuple[str, str]] = {
    "cosine": ("mima.analysis.cosine.command", "pairwise cosines of tau and delta per phase: heatmaps and box plots (paper 001 Fig. 5, 11)"),
    "landscape": ("mima.analysis.landscape.command", "error on the 2-D plane through theta_0 spanned by two task vectors (paper 001 Fig. 7)"),
    "rank-sweep": ("mima.analysis.rank_sweep.command", "CART accuracy vs kept rank; row-space interference and reconstruction error (paper 000)"),
    "ctl": ("mima.analysis.ctl.command", "cross-task linearity of features per layer under weight interpolation (paper 003)"),
    "gradients": ("mima.analysis.gradients.command", "per-epoch gradient norm shares and alignment; one-epoch vs converged merges (paper 004)"),
}
