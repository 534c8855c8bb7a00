"""Task vectors as gradients (paper 004): per-epoch gradient norm shares and alignment, and merges of
one-epoch vs converged fine-tunes.

compute.py: the fine-tuning loop, the per-epoch gradients and the merges; plot.py: the figure;
command.py: `mima analyze gradients`.
"""
