"""Which saved states a resumed run starts from, and what a run must agree on to resume them.

Processes save at different steps, but any combination of states taken inside the same phase is a
consistent cut, because each depends only on the phase's start average and its own progress; they
meet again at the phase's sync. The cut is the newest phase in which every process has a complete
state whose referenced files exist (replicas of a task additionally at the same step); damaged or
cut-off files are skipped with a note. A state written by a run with another identity (tasks, S, N,
K, mode) is refused: that is the user's mistake, not damage.

The number of processes W may change between attempts (elastic resume, mima.training.elastic): the
states of every layout found in checkpoints/ are grouped by the W that wrote them, each layout's
newest cut is found as above, and the cut that leaves the least to recompute on this run's layout
is resumed (this layout's own on a tie). A cut of another layout is re-dealt to this one. States of
another layout left in checkpoints/ranks/ are moved to checkpoints/layouts/ once every process has
loaded its own (their names could collide with this layout's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from mima.core.errors import MimaError
from mima.core.layout import TaskLayout
from mima.core.run_folder import RunFolder
from mima.core.safetensors_io import load_state_dict
from mima.training.checkpoint_format import STATE_NAME, CheckpointFiles, references
from mima.training.divergence import nonfinite_key
from mima.training.elastic import check_world_size, plan_redeal

RUN_IDENTITY_KEYS = ("tasks", "steps", "iterations", "steps_per_phase", "world_size", "mode")
LAYOUT_KEY = "world_size"  # the one identity key a resume may change (elastic resume)


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
    world_size: int = 0  # the W of the run that wrote it
    phase_state: dict = field(default_factory=dict, compare=False, repr=False)  # with file references

    @property
    def avg_phase(self) -> int:
        return int(self.phase_state.get("avg_phase", -1))

    @property
    def segments_done(self) -> int:
        """Task segments of the running phase this process has finished (their end weights are kept)."""
        return len(self.phase_state.get("segment_ends", {}))


class ResumeCut(dict):
    """The cut to resume: rank of the layout that wrote it -> its state file. `world_size` is that
    layout's W; `redeal` (mima.training.elastic.Redeal) is set when this run has another W and each
    process builds its state from the cut; `set_aside` lists states of other layouts in ranks/ that
    are moved to layouts/ (with the W that wrote them) once every process has loaded its own."""

    def __init__(self, states: dict[int, Path], world_size: int, redeal=None,
                 set_aside: Sequence[tuple[Path, int]] = ()) -> None:
        super().__init__(states)
        self.world_size = world_size
        self.redeal = redeal
        self.set_aside = list(set_aside)

    def describe(self) -> str:
        """The one state a resume starts from, in words: the phase, each process's step and the files.
        A cut may hold processes at different steps of one phase (between syncs each goes its own way,
        and a stop finds them where it finds them), so one process step alone would not name it."""
        saved = {rank: STATE_NAME.match(path.name) for rank, path in sorted(self.items())}
        phases = sorted({int(name.group(1)) for name in saved.values()})
        steps = {rank: int(name.group(2)) for rank, name in saved.items()}
        at = f"phase {', '.join(map(str, phases))}"
        folders = sorted({str(path.parent.parent) for path in self.values()})
        if len(saved) == 1:
            rank, path = next(iter(self.items()))
            return f"the state of {at} at process step {steps[rank]} ({path})"
        if len(set(steps.values())) == 1 and len({path.name for path in self.values()}) == 1 and len(folders) == 1:
            path = next(iter(self.values()))
            return (f"the states of {at} at process step {steps[min(steps)]} of all {len(steps)} processes "
                    f"({folders[0]}/rank-*/{path.name})")
        each = ", ".join(f"process {rank} at step {step}" for rank, step in steps.items())
        return f"the states of {at} with {each} ({', '.join(str(self[rank]) for rank in sorted(self))})"


@dataclass
class RunStart:
    """Where this attempt of a run starts, handed at construction to those that need it: the strategy
    loads each process's state of `cut`, the checkpoint callback stamps every state with `identity`
    and keeps the resumed state as its first. `mima fit` builds them before it may know the number of
    processes (Lightning resolves "auto" devices), so it fills this in (`settle`) once it does, and
    before training starts."""

    identity: dict | None = None  # what a saved state must agree on to be resumed (run_identity)
    cut: ResumeCut | None = None  # the cut to resume; None: a fresh start

    def settle(self, identity: dict, cut: ResumeCut | None) -> None:
        self.identity, self.cut = identity, cut

    def state_of(self, rank: int) -> Path | None:
        """The cut's state file of process `rank` of the layout that wrote it (None: a fresh start)."""
        return None if self.cut is None else self.cut.get(rank)


def _read_saved_state(path: Path, rank: int, run_dir: Path, expected: dict) -> tuple[SavedState | None, int | None, str | None]:
    """(the state in `path`, the W that wrote it, why it cannot serve a resume). A cut-off or damaged
    file, or one referring to a missing file, gives no state and a note; an identity mismatch (other
    than W) is the user's mistake and an error."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        mima = saved["mima"]
        phase, step, identity = int(mima["phase"]), int(saved["global_step"]), mima["run"]
        rank, world_size, phase_state = int(mima.get("rank", rank)), int(identity[LAYOUT_KEY]), mima["phase_state"]
    except Exception as exc:  # a cut-off or damaged file: fall back to an older state
        return None, None, f"skipping {path} (unreadable: {type(exc).__name__})"
    for key in RUN_IDENTITY_KEYS:
        if key != LAYOUT_KEY and identity.get(key) != expected[key]:
            raise MimaError(
                f"--ckpt_path: {path} was written by a run with {key}={identity.get(key)}, "
                f"but this run has {key}={expected[key]}"
            )
    for name in references(saved):
        problem = _unreadable(Path(run_dir) / name)
        if problem:
            return None, world_size, f"skipping {path} (refers to {name}: {problem})"
    return SavedState(rank, step, phase, path, world_size, dict(phase_state)), world_size, None


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


def _state_files(run_dir: Path) -> list[tuple[int, Path]]:
    """(rank from the folder name, path) of every state in checkpoints/ranks/ and checkpoints/layouts/."""
    root = CheckpointFiles(Path(run_dir)).root
    found = []
    for folder in sorted(root.glob("ranks/rank-*")) + sorted(root.glob("layouts/w*/rank-*")):
        number = folder.name.split("-", 1)[1]
        found += [(int(number) if number.isdigit() else -1, path) for path in sorted(folder.glob("phase-*-step-*.ckpt"))
                  if STATE_NAME.match(path.name)]
    return found


def layout_cut(layout: TaskLayout, states: dict[int, list[SavedState]]) -> dict[int, SavedState] | None:
    """The newest consistent cut of one layout's states (rank -> its states), None if there is none."""
    if any(not states.get(rank) for rank in range(layout.world_size)):
        return None
    newest_common_phase = min(max(s.phase for s in states[rank]) for rank in range(layout.world_size))
    for phase in range(newest_common_phase, -1, -1):
        chosen: dict[int, SavedState] = {}
        for group in layout.task_group_ranks():
            steps = [{s.step: s for s in states[rank] if s.phase == phase} for rank in group]
            common = set(steps[0]).intersection(*steps[1:])
            if not common:
                break
            chosen.update({rank: steps[i][max(common)] for i, rank in enumerate(group)})
        else:
            return chosen
    return None


def segments_done(layout: TaskLayout, cut: dict[int, SavedState]) -> int:
    """Task segments (one task, one phase) a cut has finished, counting each task once."""
    leaders = [group[0] for group in layout.task_group_ranks()]
    return sum((cut[rank].avg_phase + 1) * len(layout.local_tasks(rank)) + cut[rank].segments_done for rank in leaders)


def choose_resume(run_dir: Path, layout: TaskLayout, expected: dict) -> tuple[ResumeCut | None, list[str]]:
    """Each process's state to resume from (a consistent cut of this or another layout), or None
    when no layout has one (then the run starts afresh, which gives the same result); plus notes
    on files that were skipped and, for a cut of another layout, how it is re-dealt."""
    by_layout: dict[int, dict[int, list[SavedState]]] = {}
    layout_notes: dict[int | None, list[str]] = {}  # None: unreadable, of no known layout
    for rank, path in _state_files(run_dir):
        state, world_size, note = _read_saved_state(path, rank, run_dir, expected)
        if state is None:
            layout_notes.setdefault(world_size, []).append(note)
        else:
            by_layout.setdefault(state.world_size, {}).setdefault(state.rank, []).append(state)
    unreadable = layout_notes.get(None, [])
    here = layout.world_size
    candidates: list[tuple[int, int, int]] = []  # (segments this run need not recompute, same layout, W)
    cuts: dict[int, dict[int, SavedState]] = {}
    for world_size, states in sorted(by_layout.items()):
        if world_size != here and check_world_size(layout.num_tasks, world_size, here, raise_error=False):
            continue  # a layout this run cannot continue; refused below if it is the only one
        cut = layout_cut(TaskLayout(layout.num_tasks, world_size, layout.work), states)  # budgets cannot change on resume
        if cut is None:
            continue
        cuts[world_size] = cut
        if world_size == here:
            kept = segments_done(layout, cut)
        else:
            redeal = plan_redeal(run_dir, cut, world_size, layout, expected)
            if redeal.problem:
                layout_notes.setdefault(here, []).append(f"passing over the cut saved by {world_size} processes ({redeal.problem})")
                continue
            kept = redeal.kept
        candidates.append((kept, world_size == here, world_size))
    other = {w for w in by_layout if w != here}
    ranks_dir = CheckpointFiles(Path(run_dir)).root / "ranks"
    set_aside = [(s.path, w) for w in other for states in by_layout[w].values() for s in states
                 if s.path.parent.parent == ranks_dir]
    if not candidates:
        for world_size in sorted(other):
            check_world_size(layout.num_tasks, world_size, here)  # one line when W cannot change that way
        missing = "no complete checkpoint of every process" if by_layout else "no complete checkpoint"
        return None, unreadable + layout_notes.get(here, []) + [missing]
    _, _, chosen = max(candidates)
    cut = cuts[chosen]
    paths = {rank: state.path for rank, state in cut.items()}
    refuse_nonfinite(run_dir, list(paths.values()))
    notes = unreadable + layout_notes.get(chosen, [])
    if chosen == here:
        return ResumeCut(paths, chosen, None, set_aside), notes
    redeal = plan_redeal(run_dir, cut, chosen, layout, expected)
    return ResumeCut(paths, chosen, redeal, set_aside), notes + [redeal.describe()]


def refuse_nonfinite(run_dir: Path, states: Sequence[Path]) -> None:
    """Refuse, in one line, a cut whose states (or the files they refer to) hold a NaN or inf: training
    from it could only diverge again. mima checks every tensor before it writes it
    (mima.training.divergence), so such a state comes from an older mima or from outside. Every file
    is read once, by every process alike (they all choose the same cut), before anything is written."""
    seen: set[str] = set()
    for path in states:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        problems = [(path, nonfinite_key({key: value for key, value in saved.items() if key != "mima"}))]
        problems.append((path, nonfinite_key(saved["mima"]["phase_state"], "mima.phase_state")))
        for name in references(saved):
            if name not in seen:
                seen.add(name)
                problems.append((Path(run_dir) / name, nonfinite_key(load_state_dict(Path(run_dir) / name))))
        for file, key in problems:
            if key is not None:
                raise MimaError(
                    f"--ckpt_path last: {file} holds non-finite values ({key}), so the run cannot resume from it "
                    "(it was not written by this version of mima, which checks before it writes); "
                    "start afresh with --overwrite"
                )


def resolve_resume(
    ckpt_path: str | None, run_dir: Path, layout: TaskLayout, expected: dict
) -> tuple[ResumeCut | None, list[str]]:
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
