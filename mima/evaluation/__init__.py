"""Evaluation: per-task accuracy, the Table-1 style report, plots."""
