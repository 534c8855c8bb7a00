"""Cross-task linearity (paper 003): is the model of interpolated weights the interpolation of the models?

compute.py: features by forward hooks and the per-example statistics; plot.py: the figure;
command.py: `mima analyze ctl`.
"""
