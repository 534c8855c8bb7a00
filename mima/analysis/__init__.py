"""Analyses of fine-tuned and merged models: why a merge works (papers 000, 001, 003, 004).

Each analysis is one module with a pure function that returns numbers, a plotting function, and
`add_arguments(parser)` / `main(options)` for its `mima analyze NAME` subcommand. The command line
finds them through ANALYSES; outputs (JSON of the numbers and PNG plots) go to `--out`, by default
`<run folder>/analysis/<name>/`, which `mima report` picks up.
"""

# subcommand -> (module, one-line description)
ANALYSES: dict[str, tuple[str, str]] = {
    "cosine": ("mima.analysis.cosine", "pairwise cosines of tau and delta per phase: heatmaps and box plots (paper 001 Fig. 5, 11)"),
    "landscape": ("mima.analysis.landscape", "error on the 2-D plane through theta_0 spanned by two task vectors (paper 001 Fig. 7)"),
    "rank-sweep": ("mima.analysis.rank_sweep", "CART accuracy vs kept rank; row-space interference and reconstruction error (paper 000)"),
    "ctl": ("mima.analysis.ctl", "cross-task linearity of features per layer under weight interpolation (paper 003)"),
    "gradients": ("mima.analysis.gradients", "per-epoch gradient norm shares and alignment; one-epoch vs converged merges (paper 004)"),
}
