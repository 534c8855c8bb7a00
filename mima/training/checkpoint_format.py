"""The checkpoint files of a run: their names, and states that refer to them instead of holding tensors.

    RUN/checkpoints/
      averages/phase-PPPP.safetensors        the average after the sync ending phase P (rank 0)
      averages/phase-PPPP-outer-momentum.safetensors
                                             the outer momentum after that sync (sync_merge:
                                             outer_nesterov; rank 0), kept and removed with it
      segments/phase-PPPP/<task>.safetensors a task's end weights of phase P (the task's first
                                             replica); in the last phase final/<task>.safetensors
      moments/phase-PPPP/<task>.safetensors  that segment's AdamW moments (optimizer_state: keep)
      ranks/rank-RRRRR/phase-PPPP-step-GGGGGGGG.ckpt
                                             one process's state (loops, scheduler, RNG, phase
                                             state) with the tensors above replaced by references:
                                             a few KB at a segment boundary; saved inside a segment
                                             it holds the working encoder and its moments itself
      layouts/wWWWWW/rank-RRRRR/...          states of a layout of W processes, set aside when a run
                                             resumed on another W (elastic resume)

A reference is a small dict {REF: path relative to the run folder, "kind": ...}; `expand` puts the
tensors of the files back. When each file is written and removed: mima.training.checkpoint_callback;
which states a resume starts from: mima.training.resume.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from mima.core.run_folder import RunFolder
from mima.core.safetensors_io import load_state_dict

StateDict = dict[str, torch.Tensor]
REF = "__mima_file__"  # marks a reference: {REF: path relative to the run folder, "kind": ..., ...}
STATE_NAME = re.compile(r"^phase-(\d{4})-step-(\d{8})\.ckpt$")


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

    def outer_momentum(self, phase: int) -> Path:
        """The outer momentum after the sync ending phase P: named phase-PPPP-..., so that the rule
        that removes the averages of a phase (mima.training.checkpoint_retention) removes it too."""
        return self.root / "averages" / f"phase-{phase:04d}-outer-momentum.safetensors"

    def segment(self, phase: int, task: str, last_phase: bool) -> Path:
        if last_phase:
            return RunFolder(self.run_dir).final_file(task)
        return self.root / "segments" / f"phase-{phase:04d}" / f"{task}.safetensors"

    @property
    def moments_dir(self) -> Path:
        return self.root / "moments"

    def moments(self, phase: int, task: str) -> Path:
        return self.moments_dir / f"phase-{phase:04d}" / f"{task}.safetensors"

    def rank_dir(self, rank: int) -> Path:
        return self.root / "ranks" / f"rank-{rank:05d}"

    def set_aside_dir(self, world_size: int, rank_dir_name: str) -> Path:
        """Where states written by a layout of `world_size` processes go once a run resumes with
        another W (mima.training.elastic.set_aside): out of ranks/, still read by a later resume."""
        return self.root / "layouts" / f"w{world_size:05d}" / rank_dir_name

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


def state_writer(tensors: Mapping[str, torch.Tensor],
                 ready: Callable[[], None] | None = None) -> Callable[[Path], None]:
    """A write job for a flat state dict of PhaseState's tensors, which are never changed in place while
    a write of them is pending (a phase's average is replaced, not updated; the host buffers of end
    weights and kept moments are refilled only once their write is done, see
    mima.training.phase_state.HostBuffers): host tensors are written as they are, with no second copy
    on the training thread, once `ready()` (run on the writer's thread) says their copies from the
    device have arrived; a device tensor is brought to the CPU now."""
    on_cpu = {key: value.detach().to("cpu").contiguous() for key, value in tensors.items()}

    def write(tmp: Path) -> None:
        if ready is not None:
            ready()
        save_file(on_cpu, str(tmp))

    return write


def saved_states(run_dir: Path, rank: int) -> list[Path]:
    """A process's state files, newest first."""
    folder = CheckpointFiles(Path(run_dir)).rank_dir(rank)
    return sorted((p for p in folder.glob("phase-*-step-*.ckpt") if STATE_NAME.match(p.name)),
                  key=lambda p: int(STATE_NAME.match(p.name).group(2)), reverse=True)


def phase_of(path: Path) -> int:
    """The phase a state file belongs to, from its name."""
    return int(STATE_NAME.match(path.name).group(1))
