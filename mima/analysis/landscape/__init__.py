"""Error landscape on the plane through theta_0 spanned by two task vectors (paper 001, Fig. 7).

compute.py: the plane, the grid of errors and the marked merges; plot.py: the figure;
command.py: `mima analyze landscape`.
"""
