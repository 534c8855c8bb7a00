"""Analyses of fine-tuned and merged models: why a merge works (papers 000, 001, 003, 004).

Each analysis is a package of four modules:
  compute.py  the computation: importable functions that return numbers (no files written, no
              matplotlib, no argument parsing, no printing);
  plot.py     its figures (matplotlib only, through mima.analysis.figures);
  options.py  its `mima analyze NAME` options, `add_arguments(parser)`, and the defaults they show
              (compute.py reads them there); it imports nothing heavy, so that the help and argument
              errors answer before torch is loaded;
  command.py  the subcommand: `main(options)` loads models and tasks (mima.pools,
              mima.config.run_config, RunFolder), writes the JSON and the PNGs and prints a summary.
The command line finds the packages through ANALYSES; outputs go to `--out`, by default the run
folder's analysis folder for NAME (RunFolder.analysis_dir), which `mima report` picks up.
"""

# subcommand -> (package, one-line description)
ANALYSES: dict[str, tuple[str, str]] = {
    "cosine": ("mima.analysis.cosine", "pairwise cosines of tau and delta per phase: heatmaps and box plots (paper 001 Fig. 5, 11)"),
    "landscape": ("mima.analysis.landscape", "error on the 2-D plane through theta_0 spanned by two task vectors (paper 001 Fig. 7)"),
    "rank-sweep": ("mima.analysis.rank_sweep", "CART accuracy vs kept rank; row-space interference and reconstruction error (paper 000)"),
    "ctl": ("mima.analysis.ctl", "cross-task linearity of features per layer under weight interpolation (paper 003)"),
    "gradients": ("mima.analysis.gradients", "per-epoch gradient norm shares and alignment; one-epoch vs converged merges (paper 004)"),
}
