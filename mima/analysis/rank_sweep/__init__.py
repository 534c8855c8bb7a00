"""CART's rank sweep (paper 000): accuracy vs kept rank, row-space interference, reconstruction error.

compute.py: the sweep's merges, I(k), R(k) and the accuracy curve; plot.py: the figures;
command.py: `mima analyze rank-sweep`.
"""
