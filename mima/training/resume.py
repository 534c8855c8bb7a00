"""Which saved states a resumed run starts from, and what a run must agree on to resume them.

Processes save at different steps, but any combination of states taken inside the same phase is a
consistent cut, because each depends only on the phase's start average and its own progress; they
meet again at the phase's sync. The cut is the newest phase in which every process has a complete
state whose referenced files exist (replicas of a task additionally at the same step); damaged or
cut-off files are skipped with a note. A state written by a run with another identity (tasks, S, N,
K, W, mode) is refused: that is the user's mistake, not damage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from mima.core.errors import MimaError
from mima.core.layout import TaskLayout
from mima.core.run_folder import RunFolder
from mima.training.checkpoint_format import references, saved_states

RUN_IDENTITY_KEYS = ("tasks", "steps", "iterations", "steps_per_phase", "world_size", "mode")


def run_identity(tasks: list[str], steps: int, iterations: int, world_size: int, mode: str = "mima",
                 lengths: Sequence[int] | None = None) -> dict:
    """What a checkpoint must agree on to be resumed by a run. `steps_per_phase` is K with equal
    phases (as every checkpoint written before phase schedules says) and the list of the phases'
    lengths otherwise."""
    lengths = list(lengths) if lengths else [steps // iterations] * iterations
    identity = {"tasks": list(tasks), "steps": steps, "iterations": iterations,
                "steps_per_phase": lengths[0] if len(set(lengths)) == 1 else lengths, "world_size": world_size,
                "mode": mode}
    assert tuple(identity) == RUN_IDENTITY_KEYS
    return identity


@dataclass(frozen=True)
class SavedState:
    rank: int
    step: int
    phase: int
    path: Path


def _read_saved_state(path: Path, rank: int, run_dir: Path, expected: dict, notes: list[str]) -> SavedState | None:
    """The state in `path` if it is complete and every file it refers to exists; None (with a
    note) if it is damaged; an identity mismatch is the user's mistake and an error."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        mima = saved["mima"]
        phase, step, identity = int(mima["phase"]), int(saved["global_step"]), mima["run"]
    except Exception as exc:  # a cut-off or damaged file: fall back to an older state
        notes.append(f"skipping {path} (unreadable: {type(exc).__name__})")
        return None
    for key in RUN_IDENTITY_KEYS:
        if identity.get(key) != expected[key]:
            raise MimaError(
                f"--ckpt_path: {path} was written by a run with {key}={identity.get(key)}, "
                f"but this run has {key}={expected[key]}"
            )
    for name in references(saved):
        problem = _unreadable(Path(run_dir) / name)
        if problem:
            notes.append(f"skipping {path} (refers to {name}: {problem})")
            return None
    return SavedState(rank, step, phase, path)


def _unreadable(path: Path) -> str | None:
    """Why a referenced safetensors file cannot serve a resume (None: it can). Opening it checks that
    its header is well formed and that the data it describes fits the file's size."""
    if not path.is_file():
        return "missing"
    try:
        with safe_open(str(path), framework="pt"):
            return None
    except Exception as exc:
        return f"damaged ({type(exc).__name__})"


def choose_resume(run_dir: Path, layout: TaskLayout, expected: dict) -> tuple[dict[int, Path] | None, list[str]]:
    """Each process's state to resume from (a consistent cut), or None when some process has no
    complete state (then the run starts afresh, which gives the same result); plus notes on files
    that were skipped."""
    notes: list[str] = []
    valid: dict[int, list[SavedState]] = {}
    for rank in range(layout.world_size):
        states = [_read_saved_state(p, rank, run_dir, expected, notes) for p in saved_states(run_dir, rank)]
        valid[rank] = [s for s in states if s is not None]
        if not valid[rank]:
            return None, notes + [f"process {rank} has no complete checkpoint"]
    newest_common_phase = min(max(s.phase for s in states) for states in valid.values())
    for phase in range(newest_common_phase, -1, -1):
        chosen: dict[int, Path] = {}
        for group in layout.task_group_ranks():
            steps = [{s.step: s for s in valid[rank] if s.phase == phase} for rank in group]
            common = set(steps[0]).intersection(*steps[1:])
            if not common:
                break
            chosen.update({rank: steps[i][max(common)].path for i, rank in enumerate(group)})
        else:
            return chosen, notes
    return None, notes + ["no phase in which every process has a complete checkpoint"]


def resolve_resume(
    ckpt_path: str | None, run_dir: Path, layout: TaskLayout, expected: dict
) -> tuple[dict[int, Path] | None, list[str]]:
    """`--ckpt_path`: "last" (this run folder's checkpoints) or the path of this run folder or its
    checkpoints/ folder. Returns the cut to resume from (None: start afresh) and notes to print."""
    if ckpt_path is None:
        return None, []
    run = RunFolder(run_dir)
    if ckpt_path != "last":
        given = Path(ckpt_path)
        if not given.exists():
            raise MimaError(f"--ckpt_path {ckpt_path}: no such checkpoint")
        if given.resolve() not in (run.path.resolve(), run.checkpoints_dir.resolve()):
            raise MimaError(
                f"--ckpt_path {ckpt_path}: a run resumes in its own folder; pass --out <that run folder> "
                "--ckpt_path last (checkpoints refer to the run folder's other files)"
            )
    if not run.checkpoints_dir.is_dir():
        return None, []
    return choose_resume(run_dir, layout, expected)




def log_resume(notes: list[str]) -> None:
    """What the resume skipped and why, on stdout beside the "resuming from" line (printed, not logged:
    a user must see which file was passed over, whatever the logging configuration)."""
    for note in notes:
        print(f"mima fit: {note}", flush=True)
