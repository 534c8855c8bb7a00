"""Checkpoints that write each byte once, per process, in the background, with no collective.

What must survive a crash is small at most moments: a task's end weights of a phase, the phase
average and (with `optimizer_state: keep`) each task's AdamW moments are immutable once made, so
each is written once, as its own file, and a process's checkpoint refers to them by name:

    RUN/checkpoints/
      averages/phase-PPPP.safetensors        the average after the sync ending phase P (rank 0)
      segments/phase-PPPP/<task>.safetensors a task's end weights of phase P (the task's first
                                             replica); in the last phase final/<task>.safetensors
      moments/phase-PPPP/<task>.safetensors  that segment's AdamW moments (optimizer_state: keep)
      ranks/rank-RRRRR/phase-PPPP-step-GGGGGGGG.ckpt
                                             one process's Lightning checkpoint (loops, scheduler,
                                             RNG, callback state) with the tensors above replaced by
                                             references: a few KB at a segment boundary; saved
                                             inside a segment it holds the working encoder and its
                                             moments itself

Files are written only when a checkpoint first refers to them, by a background thread
(mima.training.background_writer: FIFO, temporary file, fsync, rename), so training goes on while
bytes reach the disk and a kill mid-write leaves every earlier file intact.

When to save (`--checkpoint_every`): "segment" (default: every task segment end, so a crash loses
at most K steps), "phase" (only at syncs: fewer, smaller files, up to one phase of a process lost),
a number n (every n process steps and at every sync; inside a segment a save holds the encoder and
its moments: 1-3 encoder sizes per process), or 0 (never). A stop request (signal or RUN/STOP, see
mima.training.preemption) saves at the next step boundary whatever the choice.

Resuming (`choose_resume`): processes save at different steps, but any combination of states taken
inside the same phase is a consistent cut, because each depends only on the phase's start average
and its own progress; they meet again at the phase's sync. The cut is the newest phase in which
every process has a complete state whose referenced files exist (replicas of a task additionally at
the same step); damaged or cut-off files are skipped with a message. Before each sync every process
waits for its own writes, so after the sync ending phase P the states of phases < P are never needed
again and are removed, with the files only they referred to. After a successful run the whole
checkpoints folder is removed unless `--keep_checkpoints` is given.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from mima.core.errors import MimaError
from mima.core.layout import TaskLayout
from mima.core.run_folder import RunFolder
from mima.core.safetensors_io import load_state_dict
from mima.training.background_writer import BackgroundWriter
from mima.training.preemption import stop_agreement

StateDict = dict[str, torch.Tensor]
REF = "__mima_file__"  # marks a reference: {REF: path relative to the run folder, "kind": ..., ...}
SYNC_STATE_KEY = "MimaSyncCallback"
RUN_IDENTITY_KEYS = ("tasks", "steps", "iterations", "steps_per_phase", "world_size", "mode")
_STATE_NAME = re.compile(r"^phase-(\d{4})-step-(\d{8})\.ckpt$")


def run_identity(tasks: list[str], steps: int, iterations: int, world_size: int, mode: str = "mima") -> dict:
    """What a checkpoint must agree on to be resumed by a run."""
    identity = {"tasks": list(tasks), "steps": steps, "iterations": iterations,
                "steps_per_phase": steps // iterations, "world_size": world_size, "mode": mode}
    assert tuple(identity) == RUN_IDENTITY_KEYS
    return identity


# ---------------------------------------------------------------------------------- names
@dataclass(frozen=True)
class CheckpointFiles:
    """File names inside a run's checkpoints/ folder; references are relative to the run folder."""

    run_dir: Path

    @property
    def root(self) -> Path:
        return RunFolder(self.run_dir).checkpoints_dir

    def average(self, phase: int) -> Path:
        if phase < 0:  # the start of phase 0 is theta_0
            return RunFolder(self.run_dir).pretrained_file
        return self.root / "averages" / f"phase-{phase:04d}.safetensors"

    def segment(self, phase: int, task: str, last_phase: bool) -> Path:
        if last_phase:
            return RunFolder(self.run_dir).final_file(task)
        return self.root / "segments" / f"phase-{phase:04d}" / f"{task}.safetensors"

    def moments(self, phase: int, task: str) -> Path:
        return self.root / "moments" / f"phase-{phase:04d}" / f"{task}.safetensors"

    def rank_dir(self, rank: int) -> Path:
        return self.root / "ranks" / f"rank-{rank:05d}"

    def state(self, rank: int, phase: int, step: int) -> Path:
        return self.rank_dir(rank) / f"phase-{phase:04d}-step-{step:08d}.ckpt"

    def relative(self, path: Path) -> str:
        return str(Path(path).relative_to(self.run_dir))


def reference(files: CheckpointFiles, path: Path, kind: str, **extra) -> dict:
    return {REF: files.relative(path), "kind": kind, **extra}


# ------------------------------------------------------------------ optimiser moments as files
def flatten_moments(state: Mapping[int, Mapping[str, object]]) -> StateDict:
    """AdamW's per-parameter state {param: {"step", "exp_avg", "exp_avg_sq"}} as flat tensors."""
    flat: StateDict = {}
    for param, moments in state.items():
        for name, value in moments.items():
            if not torch.is_tensor(value):
                raise TypeError(f"optimiser state {param}.{name} is not a tensor; cannot be stored as safetensors")
            flat[f"{param}.{name}"] = value
    return flat


def unflatten_moments(flat: Mapping[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        param, name = key.split(".", 1)
        state.setdefault(int(param), {})[name] = value
    return state


# --------------------------------------------------------------------- references <-> tensors
def expand(obj: object, run_dir: Path) -> object:
    """A saved state with every reference replaced by the tensors of the file it names."""
    if isinstance(obj, dict):
        if REF in obj:
            return _load_reference(obj, run_dir)
        return {key: expand(value, run_dir) for key, value in obj.items()}
    if isinstance(obj, list):
        return [expand(value, run_dir) for value in obj]
    return obj


def _load_reference(ref: Mapping, run_dir: Path) -> object:
    tensors = load_state_dict(Path(run_dir) / ref[REF])
    if ref["kind"] == "moments":
        return unflatten_moments(tensors)
    prefix = ref.get("prefix", "")
    loaded = {prefix + key: value for key, value in tensors.items()}
    return {**loaded, **ref.get("extra", {})}


def references(obj: object) -> list[str]:
    """The files a saved state refers to (relative to the run folder)."""
    if isinstance(obj, dict):
        if REF in obj:
            return [obj[REF]]
        return [path for value in obj.values() for path in references(value)]
    if isinstance(obj, list):
        return [path for value in obj for path in references(value)]
    return []


def cpu_snapshot(obj: object) -> object:
    """A copy of a checkpoint with every tensor on the CPU, safe to write while training goes on."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: cpu_snapshot(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_snapshot(value) for value in obj)
    return obj


# -------------------------------------------------------------------------------- resuming
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


def saved_states(run_dir: Path, rank: int) -> list[Path]:
    """A process's state files, newest first."""
    folder = CheckpointFiles(Path(run_dir)).rank_dir(rank)
    return sorted((p for p in folder.glob("phase-*-step-*.ckpt") if _STATE_NAME.match(p.name)),
                  key=lambda p: int(_STATE_NAME.match(p.name).group(2)), reverse=True)


def _phase_of(path: Path) -> int:
    return int(_STATE_NAME.match(path.name).group(1))


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


# --------------------------------------------------------------------------- the callback
class MimaCheckpoint(Checkpoint):
    """Saves each process's state as described in the module docstring; acts on stop requests.

    Args:
        every: "segment", "phase" or a number of process steps (see the module docstring).
        keep: keep the checkpoints folder after the run has finished.
    """

    def __init__(self, every: str | int = "segment", keep: bool = False) -> None:
        self.every = every
        self.keep = keep
        self.writer: BackgroundWriter | None = None
        self.files: CheckpointFiles | None = None
        self.queued: set[Path] = set()  # files this process has written or queued
        self.stopped_by: int | None = None
        self.completed_syncs = 0
        self.inline_states: list[Path] = []  # this attempt's saves that hold an encoder themselves
        self.queued_first = False
        self.bytes_written = 0

    # ------------------------------------------------------------------------- lifecycle
    def on_train_start(self, trainer, pl_module) -> None:
        self.files = CheckpointFiles(Path(trainer.default_root_dir))
        self.writer = BackgroundWriter()
        stop_agreement(trainer).install()
        if trainer.ckpt_path is None:  # a fresh start: whatever an earlier attempt left is stale
            trainer.strategy.barrier("mima: fresh start")
            if trainer.is_global_zero:
                shutil.rmtree(self.files.root, ignore_errors=True)
            trainer.strategy.barrier("mima: stale checkpoints removed")
        self.completed_syncs = _completed_syncs(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not getattr(pl_module, "stepped", True):
            return  # a micro-batch that only accumulated gradients: no step boundary
        step, plan = trainer.global_step, pl_module.plan
        stop = stop_agreement(trainer)
        if step >= plan.local_steps:
            return  # finished: final/ holds the result
        synced = _completed_syncs(pl_module)
        stopping = stop.stopped_by is not None or stop.at_step(plan.position(step).phase)
        if stopping or self._scheduled(step, pl_module):
            self.save(trainer, pl_module)
        if synced > self.completed_syncs:
            self._forget_before(trainer, pl_module, synced - 1)
            self.completed_syncs = synced
        if stopping:
            self.stopped_by = stop.stopped_by if stop.stopped_by is not None else 0
            trainer.should_stop = True

    def before_sync(self) -> None:
        """Called by the sync callback before it waits for the others: this process's states of
        the phase must be on disk before any process moves past it (see `_forget_before`)."""
        if self.writer is not None:
            self.writer.flush()

    def on_train_end(self, trainer, pl_module) -> None:
        self.writer.close()
        self.bytes_written = self.writer.bytes_written
        finished = trainer.global_step >= pl_module.plan.local_steps and self.stopped_by is None
        trainer.strategy.barrier("mima: every process has finished writing")
        if finished and trainer.is_global_zero:
            for path in RunFolder(self.files.run_dir).replaced_runs() + ([] if self.keep else [self.files.root]):
                shutil.rmtree(path, ignore_errors=True)

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self.writer is not None:
            try:
                self.writer.flush()  # what was queued is still a valid, older state
            except Exception:
                pass

    def _scheduled(self, step: int, pl_module) -> bool:
        plan = pl_module.plan
        if pl_module.hparams.mode == "joint":
            every = plan.total_steps // pl_module.hparams.iterations if self.every in ("segment", "phase") else self.every
            return step % every == 0
        at_sync = plan.ends_phase(step - 1)
        if self.every == "segment":
            return plan.ends_segment(step - 1)
        if self.every == "phase":
            return at_sync
        return at_sync or step % int(self.every) == 0

    # ------------------------------------------------------------------------------ save
    def save(self, trainer, pl_module) -> None:
        # Lightning's trainer.save_checkpoint ends with a barrier over all processes; MIMA's processes
        # save at different steps, so the checkpoint dict is built with the connector it uses.
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        sync = _sync_callback(trainer)
        plan = pl_module.plan
        step = trainer.global_step
        phase = checkpoint["mima"]["phase"] = plan.position(step).phase
        inline = sync is None or not self._compact(trainer, pl_module, sync, checkpoint)
        path = self.files.state(trainer.global_rank, phase, step)
        self._write(path, lambda tmp, state=cpu_snapshot(checkpoint): torch.save(state, tmp))
        if trainer.is_global_zero and not self.queued_first:
            # the run that --overwrite replaced goes once this run can be resumed on its own
            self.writer.submit_removal(RunFolder(self.files.run_dir).replaced_runs())
            self.queued_first = True
        if inline:
            # Two are kept, not one: a replica's newest may be the one a killed partner did not finish.
            self.inline_states.append(path)
            if len(self.inline_states) > 2:
                self.writer.submit_removal([self.inline_states.pop(0)])

    def _compact(self, trainer, pl_module, sync, checkpoint: dict) -> bool:
        """Replace the tensors that live in immutable files by references (writing those files once);
        True if the working encoder and optimiser state were among them (a segment boundary)."""
        plan, layout, rank = pl_module.plan, pl_module.layout, trainer.global_rank
        leader, last = layout.is_leader(rank), plan.iterations - 1
        state = checkpoint["callbacks"][SYNC_STATE_KEY]
        avg_file = self.files.average(sync.avg_phase)
        self._ensure(avg_file, trainer.is_global_zero, lambda: _state_writer(sync.avg))
        state["avg"] = reference(self.files, avg_file, "state")
        for slot, weights in sync.segment_ends.items():
            task = plan.tasks[plan.local_tasks[slot]]
            file = self.files.segment(sync.segment_phase, task, sync.segment_phase == last)
            self._ensure(file, leader, lambda w=weights: _state_writer(w))
            state["segment_ends"][slot] = reference(self.files, file, "state")
        for slot, moments in sync.task_moments.items():
            task = plan.tasks[plan.local_tasks[slot]]
            file = self.files.moments(sync.moments_phase[slot], task)
            self._ensure(file, leader, lambda m=moments: _state_writer(flatten_moments(m)))
            state["task_moments"][slot] = reference(self.files, file, "moments")
        boundary = sync.boundary(plan, trainer.global_step)
        if boundary is None:
            return False  # inside a segment: the working encoder and its moments are saved inline
        weights_ref, moments_ref = boundary
        source = state["avg"] if weights_ref == "avg" else state["segment_ends"][weights_ref]
        encoder = {k[len("encoder."):]: v for k, v in checkpoint["state_dict"].items() if k.startswith("encoder.")}
        referenced = set(sync.avg) if weights_ref == "avg" else set(encoder)
        others = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("encoder.")}
        extra = {f"encoder.{k}": v for k, v in encoder.items() if k not in referenced} | others
        checkpoint["state_dict"] = {**source, "prefix": "encoder.", "extra": extra}
        optimizer = checkpoint["optimizer_states"][0]
        optimizer["state"] = state["task_moments"][moments_ref] if moments_ref is not None else {}
        return True

    def _ensure(self, path: Path, responsible: bool, make) -> None:
        """Queue a file once, on the process responsible for it; the others only refer to it."""
        if not responsible or path in self.queued or path.is_file():
            return
        self._write(path, make())
        self.queued.add(path)

    def _write(self, path: Path, write) -> None:
        self.writer.submit(path, write)

    # ----------------------------------------------------------------------------- tidy up
    def _forget_before(self, trainer, pl_module, synced_phase: int) -> None:
        """After the sync ending `synced_phase` every process's states of that phase are on disk,
        so states of earlier phases (and the files only they refer to) are never needed again."""
        rank, files = trainer.global_rank, self.files
        obsolete = [p for p in saved_states(files.run_dir, rank) if _phase_of(p) < synced_phase]
        self.inline_states = [p for p in self.inline_states if p not in obsolete]
        shared: list[Path] = []
        if trainer.is_global_zero:  # the shared files, by one process
            shared += _older(files.root / "averages", synced_phase - 1)
            shared += _older(files.root / "segments", synced_phase)
            shared += _older(files.root / "moments", synced_phase - 1)
        self.writer.submit_removal(obsolete + shared)


def _older(folder: Path, phase: int) -> list[Path]:
    """Entries phase-PPPP(.safetensors) of `folder` with PPPP < phase."""
    found = []
    for entry in folder.glob("phase-*"):
        number = re.match(r"phase-(\d+)", entry.name)
        if number and int(number.group(1)) < phase:
            found.append(entry)
    return found


def _state_writer(tensors: Mapping[str, torch.Tensor]):
    """A write job for a flat state dict; the CPU copy is taken now, while the tensors are current."""
    snapshot = {key: value.detach().to("cpu", copy=True).contiguous() for key, value in tensors.items()}
    return lambda tmp: save_file(snapshot, str(tmp))


def _sync_callback(trainer):
    from mima.training.sync import MimaSyncCallback

    return next((c for c in trainer.callbacks if isinstance(c, MimaSyncCallback)), None)


def _completed_syncs(pl_module) -> int:
    sync = _sync_callback(pl_module.trainer)
    return 0 if sync is None else sync.avg_phase + 1


def log_resume(notes: list[str]) -> None:
    """What the resume skipped and why, on stdout beside the "resuming from" line (printed, not logged:
    a user must see which file was passed over, whatever the logging configuration)."""
    for note in notes:
        print(f"mima fit: {note}", flush=True)
