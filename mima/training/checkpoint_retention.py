"""Which checkpoint files a resume can still need: the committed cut, and what may go.

A process's state is *durable* once the background writer has renamed it into place; the files it
refers to are on disk before it (the writer is FIFO). The *committed phase* C is the newest phase in
which every process has a durable state: from then on a resume starts in phase C or later
(mima.training.resume takes the newest phase in which every process has a complete state), however
the processes die. A process's *committed state* is its newest durable state of phase C (for
replicas of a task: one that every replica has made durable, since they resume at a common step).

Processes learn C without a collective and without waiting: each one counts itself, in the stop
store (mima.training.preemption), into one counter per phase ("processes with a durable state in this
phase or a later one"), and reads the counters when it tidies up. With one process there is no store
and C is its own durable phase.

What MimaCheckpoint removes, once known (`Retention`):
  * kept AdamW moments: a task's moments of older phases as soon as its leader's committed state
    refers to newer ones, so one generation stays on disk (plus, for a moment, the one it replaces);
  * states, averages and segment ends older than the previous committed cut (that cut stays as a
    fallback for a damaged newest state, where the moments it needs are still there);
  * the process's own older states that refer to a file already removed (no resume could use them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from mima.training.checkpoint_format import CheckpointFiles, phase_of, saved_states

PHASE_ENTRY = re.compile(r"^phase-(\d+)")


@dataclass
class StateRecord:
    """One state this process saved (or resumed from)."""

    path: Path
    phase: int
    step: int
    refs: frozenset[str] = frozenset()  # the files it refers to, relative to the run folder
    durable: bool = False  # set by the writer thread once the file is in place

    def mark_durable(self) -> None:
        self.durable = True


class Commitments:
    """This process's side of the shared record of durable states (see the module docstring)."""

    def __init__(self, store: dist.Store | None, world_size: int, rank: int, partners: list[int]) -> None:
        self.store, self.world_size, self.rank = store, world_size, rank
        self.partners = [r for r in partners if r != rank]  # the other replicas of this process's task
        self.durable_phase = -1  # newest phase this process has counted itself into
        self.durable_step = -1
        self.committed = -1

    def publish(self, phase: int, step: int) -> None:
        """This process has a durable state at (phase, step)."""
        if self.store is not None:
            for counted in range(self.durable_phase + 1, phase + 1):
                self.store.add(f"mima/ckpt/durable/{counted}", 1)
            if self.partners and step > self.durable_step:
                self.store.set(f"mima/ckpt/step/{self.rank}", str(step))
        self.durable_phase = max(self.durable_phase, phase)
        self.durable_step = max(self.durable_step, step)

    def committed_phase(self) -> int:
        """C: the newest phase in which every process has a durable state (-1: none yet)."""
        if self.store is None:
            return self.durable_phase
        while self.store.add(f"mima/ckpt/durable/{self.committed + 1}", 0) >= self.world_size:
            self.committed += 1
        return self.committed

    def partners_reached(self, step: int) -> bool:
        """Whether every other replica of this process's task has a durable state at `step` or later."""
        for rank in self.partners:
            key = f"mima/ckpt/step/{rank}"
            if self.store is None or not self.store.check([key]) or int(self.store.get(key)) < step:
                return False
        return True


@dataclass
class Retention:
    """Decides, from what is committed, which of the run's checkpoint files a process removes."""

    files: CheckpointFiles
    rank: int
    leader: bool  # writes its tasks' segment ends and moments
    removes_shared: bool  # process 0: the averages and segment folders
    cuts: list[int] = field(default_factory=list)  # committed phases seen so far
    removed: set[str] = field(default_factory=set)  # relative paths this process has removed or queued

    def removable(self, states: list[StateRecord], committed: int, cut: StateRecord | None) -> list[Path]:
        """What may go now that phase `committed` is committed and `cut` is this process's committed state."""
        if committed >= 0 and (not self.cuts or committed > self.cuts[-1]):
            self.cuts.append(committed)  # a cut seen late (a process's newest-so-far) never goes back
        found: list[Path] = []
        if cut is not None and self.leader:
            found += self._replaced_moments(cut)
        fallback = self.cuts[-2] if len(self.cuts) > 1 else None
        if fallback is not None:
            found += [p for p in saved_states(self.files.run_dir, self.rank) if phase_of(p) < fallback]
            if self.removes_shared:
                # states of phase >= fallback start from the average after phase fallback - 1
                found += _entries_before(self.files.root / "averages", fallback - 1)
                found += _entries_before(self.files.root / "segments", fallback)
                found += _entries_before(self.files.moments_dir, fallback - 1)  # folders left empty
        gone = self.removed | {self.files.relative(p) for p in found}
        if cut is not None:
            for record in states:
                # (a state still being written will find its files: they are queued before it)
                if record.step < cut.step and record.path not in found and any(
                        ref in gone or (record.durable and not (self.files.run_dir / ref).exists()) for ref in record.refs):
                    found.append(record.path)  # refers to a removed file: no resume can use it
        found = [p for p in found if self.files.relative(p) not in self.removed]
        self.removed |= {self.files.relative(p) for p in found}
        # states first: a kill between two removals never leaves a state that refers to a missing file
        return sorted(found, key=lambda path: path.suffix != ".ckpt")

    def _replaced_moments(self, cut: StateRecord) -> list[Path]:
        """The moments files of the tasks `cut` refers to that are older than the ones it refers to."""
        older = []
        for ref in cut.refs:
            path = self.files.run_dir / ref
            generation = PHASE_ENTRY.match(path.parent.name)
            if path.parent.parent != self.files.moments_dir or generation is None:
                continue
            phase, task = int(generation.group(1)), path.stem
            for file in self.files.moments_dir.glob(f"phase-*/{task}.safetensors"):
                entry = PHASE_ENTRY.match(file.parent.name)
                if entry and int(entry.group(1)) < phase:
                    older.append(file)
        return older


def _entries_before(folder: Path, phase: int) -> list[Path]:
    """Entries phase-PPPP(.safetensors) of `folder` with PPPP < phase."""
    return [entry for entry in folder.glob("phase-*")
            if (number := PHASE_ENTRY.match(entry.name)) and int(number.group(1)) < phase]
