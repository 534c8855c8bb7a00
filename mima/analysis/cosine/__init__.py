"""Alignment of the task models during MIMA: pairwise cosines of tau and delta, phase by phase.

compute.py: the numbers (no files, no plots); plot.py: the figures; command.py: `mima analyze cosine`
and `analyse`, which `mima report` calls to draw the plots of a run or sweep folder.
"""
