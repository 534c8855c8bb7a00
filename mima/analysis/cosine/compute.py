"""Alignment of the task models during MIMA: pairwise cosines of tau and delta, phase by phase.

Paper 001 (MIMA), Fig. 5 and Fig. 11. At the end of phase i the trainer's sync callback logs, over
the trainable parameters of the encoder,
    tau_t   = theta_t - theta_0                 (the task vector so far)
    delta_t = theta_t - avg_(i-1)               (the phase's own update; avg_0 = theta_0)
and the T x T matrices of their pairwise cosines (the run's phase records, keys cos_tau and
cos_delta). This analysis needs no data and no model: it reads those matrices. Under MIMA the tau
cosines rise phase after phase while the delta cosines stay low: the models are pulled into a
shared region by the averaging, not by similar updates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mima.core.errors import MimaError

# phases drawn side by side in the heatmap figure: a report page shows it about 900 px wide, and with
# six columns the numbers in its cells shrank to about 5 px there
MAX_HEATMAP_PHASES = 4


@dataclass
class PhaseCosines:
    phase: int
    step: int  # per-task optimiser steps done at the end of the phase
    cos_tau: np.ndarray  # T x T
    cos_delta: np.ndarray  # T x T


@dataclass
class RunCosines:
    path: Path
    n: int
    tasks: list[str]
    phases: list[PhaseCosines]

    @property
    def final(self) -> PhaseCosines:
        return self.phases[-1]


def off_diagonal(matrix: np.ndarray) -> np.ndarray:
    """The values above the diagonal: each pair of tasks once."""
    rows, cols = np.triu_indices(matrix.shape[0], k=1)
    return matrix[rows, cols]


def run_cosines(path: Path, n: int, records: Sequence[dict]) -> RunCosines:
    """The per-phase cosine matrices of one run's phase records (as `mima fit` logs them)."""
    if not records:
        raise MimaError(f"{path}: no phase records (is this a `mima fit` run folder?)")
    missing = [r["phase"] for r in records if "cos_tau" not in r or "cos_delta" not in r]
    if missing:
        raise MimaError(f"{path}: phase {missing[0]} has no cos_tau/cos_delta matrices in its phase record")
    phases = [
        PhaseCosines(int(r["phase"]), int(r["step"]), np.array(r["cos_tau"], dtype=float), np.array(r["cos_delta"], dtype=float))
        for r in records
    ]
    return RunCosines(path, n, list(records[0]["tasks"]), phases)


def check_runs(runs: Sequence[RunCosines]) -> list[RunCosines]:
    """The runs in order of N; they must share their tasks and differ in N."""
    runs = sorted(runs, key=lambda run: run.n)
    if len({tuple(run.tasks) for run in runs}) > 1:
        raise MimaError(f"the runs have different tasks ({runs[0].path}: {runs[0].tasks}, {runs[-1].path}: {runs[-1].tasks})")
    if len({run.n for run in runs}) != len(runs):
        raise MimaError("two runs with the same N: give one run per N (compare other settings in separate calls)")
    return runs


def heatmap_phases(count: int, most: int = MAX_HEATMAP_PHASES) -> list[int]:
    """Indices of the phases to draw: all of them up to `most`, else first, last and evenly between."""
    if count <= most:
        return list(range(count))
    return sorted({round(i * (count - 1) / (most - 1)) for i in range(most)})


def cosine_table(runs: Sequence[RunCosines]) -> dict:
    """The numbers of the analysis (cosine.json without its timing): per run and phase, the matrices
    and the mean of their off-diagonal values."""
    return {
        "tasks": runs[0].tasks,
        "runs": [
            {
                "path": str(run.path),
                "N": run.n,
                "phases": [
                    {
                        "phase": p.phase,
                        "step": p.step,
                        "mean_cos_tau": float(off_diagonal(p.cos_tau).mean()) if len(run.tasks) > 1 else math.nan,
                        "mean_cos_delta": float(off_diagonal(p.cos_delta).mean()) if len(run.tasks) > 1 else math.nan,
                        "cos_tau": p.cos_tau.tolist(),
                        "cos_delta": p.cos_delta.tolist(),
                    }
                    for p in run.phases
                ],
            }
            for run in runs
        ],
    }
