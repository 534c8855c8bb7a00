"""Stopping a run early without a per-step collective over all processes.

A stop is requested by a signal to any process (SIGUSR1: SLURM's warning before the time limit,
SIGTERM: preemption or `scancel`) or by a file `STOP` in the run folder (`touch RUN/STOP`).
Processes of a MIMA run take different numbers of steps between two syncs (a process may own one
task more than another) and only meet at the phase-end sync, so they cannot agree on a stop step
with a collective at every step. They agree through a key-value store instead (a TCPStore of mima's
own, served by process 0: `stop_store`), one key per phase:

  * A process that sees a request at a step boundary inside phase p claims the phase's decision
    for "stop" (an atomic compare-and-set) and stops there, saving its state.
  * A process that reaches the sync of phase p registers its arrival and waits until either every
    process has arrived (it then claims "go" and enters the averaging collective) or the decision
    is "stop" (it saves its state, sync still pending, and stops).
  * Every process also reads the decision of its current phase at step boundaries, at most every
    LOOK_EVERY_S seconds (a store round trip at every step would cost each step, and load the
    store's host with every process's queries); its own signal and the STOP file it sees at once.
  * A process that diverges (mima.training.divergence) claims the phase's decision for "diverged"
    and leaves its report under one key: the others stop as at a "stop" (saving their states), it
    saves nothing more, and every process's `mima fit` ends with that report.
Whichever claim comes first wins, so either every process enters the sync of phase p or none
does; every process stops inside the same phase, and their saved states form a consistent cut
(mima.training.resume resumes each process from its own). Replicas of one task (W > T)
train in lockstep and must stop at the same step: they combine what they saw with one small
all-reduce inside their task group per step (they all-reduce gradients there anyway).
"""

from __future__ import annotations

import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mima.config.defaults import COLLECTIVE_TIMEOUT_S
from mima.core.errors import MimaError
from mima.core.run_folder import RunFolder

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
GO = b"go"
DIVERGED = b"diverged"  # a phase's decision when a process diverged (mima.training.divergence)
DIVERGED_FLAG = 1 << 20  # in the replicas' per-step all-reduce: above any signal number, so it wins
DIVERGENCE = "mima/divergence"  # the first divergence's report, for the line every process's run ends with
FAILED = "mima/failed"
POLL_S = 0.002
LOOK_EVERY_S = 0.5  # how often a process asks the store whether another one has claimed "stop"

_received: list[int] = []  # signals this process has seen and not yet acted on


def _remember_signal(signum, frame) -> None:
    _received.append(int(signum))


def _stop_value(signum: int) -> bytes:
    return f"stop:{signum}".encode()


def _signal_of(decision: bytes) -> int | None:
    """The signal number a stop decision carries (0: the STOP file), None for "go"."""
    return int(decision.split(b":")[1]) if decision.startswith(b"stop:") else None


def _flag_of(decision: bytes | None) -> int:
    """A step's decision as one number, for the replicas' all-reduce: -1 no stop, a signal number
    (0: the STOP file), or DIVERGED_FLAG."""
    if decision == DIVERGED:
        return DIVERGED_FLAG
    signum = _signal_of(decision) if decision is not None else None
    return -1 if signum is None else signum


class StopAgreement:
    """The stop protocol of one process (see the module docstring). Made by `mima fit` before the
    processes exist and handed to the strategy and the callbacks; the strategy `connect`s it once the
    process group is up.

    Args:
        run_dir: the run folder (where `STOP` is looked for).
        enabled: False when nothing could be saved (checkpointing off): requests are ignored.
        timeout_s: seconds a process waits at a sync for the others before the run fails (a process
            that died cannot hang the job; one that failed with an error says so at once), on top of
            the time the plan gives the others to finish their steps (`at_sync`'s allowance).
    """

    def __init__(self, run_dir: Path, enabled: bool = True, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        self.enabled = enabled
        self.timeout_s = timeout_s  # how long a sync waits for the other processes (as a collective would)
        self.stop_file = RunFolder(Path(run_dir)).stop_file
        self.world_size = 1
        self.task_group = None
        self.device = torch.device("cpu")
        self.store: dist.Store | None = None
        self.stopped_by: int | None = None  # signal number that stopped the run; 0: the STOP file
        self.divergence: str | None = None  # the report of the divergence that stopped the run
        self.diverged_here = False  # this process (or a replica of its task) diverged: nothing more is saved
        self.waits: list[float] = []  # seconds this process waited at each sync for the others
        self.allowance_s = 0.0  # at the running sync: how much longer than timeout_s the others may take
        self._next_look = 0.0  # time.monotonic() from which at_step asks the store again

    def connect(self, world_size: int, task_group, device: torch.device, store: dist.Store | None) -> None:
        """Join the other processes: `store` (None for one process) is where they agree; `task_group`
        the process group of this process's task replicas (None: no replicas), on `device`."""
        self.world_size, self.task_group, self.device, self.store = world_size, task_group, device, store

    def install(self) -> None:
        """Take over SIGUSR1 and SIGTERM: from now on they only request a stop."""
        _received.clear()
        if self.enabled:
            for signum in SIGNALS:
                signal.signal(signum, _remember_signal)

    # ------------------------------------------------------------------------- requests
    def _requested(self) -> int | None:
        """This process's own request: a signal number, 0 for the STOP file, None for none."""
        if not self.enabled:
            return None
        if _received:
            return _received[-1]
        if self.stop_file.exists():
            return 0
        return None

    def _key(self, phase: int) -> str:
        return f"mima/stop/{phase}"

    def _claim(self, phase: int, value: bytes) -> bytes:
        if self.store is None:
            return value
        return self.store.compare_set(self._key(phase), "", value)

    def _decided(self, phase: int) -> bytes | None:
        if self.store is None or not self.store.check([self._key(phase)]):
            return None
        return self.store.get(self._key(phase))

    # ---------------------------------------------------------------------- the protocol
    def diverge(self, phase: int, report: str) -> None:
        """This process diverged inside `phase` (before its sync): it saves nothing more and stops
        after this step; the others learn it from the store (the phase's decision) at their next
        look, or at the sync, and stop too. The first report any process makes is the run's."""
        self.diverged_here = True
        if self.divergence is not None:
            return
        self.divergence = report
        if self.store is not None:
            self.store.compare_set(DIVERGENCE, "", report.encode())
            self._claim(phase, DIVERGED)

    def _learn_divergence(self) -> None:
        """Another process diverged: its report, as it left it in the store."""
        if self.divergence is None:
            found = self.store is not None and self.store.check([DIVERGENCE])
            self.divergence = self.store.get(DIVERGENCE).decode() if found else "a process diverged"

    def at_step(self, phase: int) -> bool:
        """At a step boundary inside `phase`: True if the process must stop now (and save, unless
        the stop is a divergence of its own task: `diverged_here`)."""
        if not self.enabled:
            return self.divergence is not None
        requested = self._requested()
        if self.diverged_here:
            decision = DIVERGED  # claimed by `diverge`
        elif requested is not None:
            # a claim cannot come back "go": this process has not arrived at the phase's sync
            decision = self._claim(phase, _stop_value(requested))
        else:
            decision = self._decided(phase) if self._look_now() else None
        flag = _flag_of(decision)
        if self.task_group is not None:  # replicas stop together (-1: no stop); a divergence wins
            shared = torch.tensor([flag], device=self.device)
            dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=self.task_group)
            if int(shared.item()) == DIVERGED_FLAG and flag != DIVERGED_FLAG:
                self.diverged_here = True  # a replica's weights are this process's too
            flag = int(shared.item())
        if flag == DIVERGED_FLAG:
            self._learn_divergence()
            return True
        self.stopped_by = None if flag < 0 else flag
        return self.stopped_by is not None

    def _look_now(self) -> bool:
        """True at most every LOOK_EVERY_S: time to read another process's claim from the store."""
        now = time.monotonic()
        if now < self._next_look:
            return False
        self._next_look = now + LOOK_EVERY_S
        return True

    def at_sync(self, phase: int, allowance_s: float = 0.0) -> bool:
        """At the sync ending `phase`: True to enter it, False if the run stops before it. The process
        waits up to timeout_s + `allowance_s` (the time the others may legitimately still train:
        mima.training.sync_deadline) before it declares a process dead."""
        if self.store is None:
            return not self.at_step(phase)
        self.allowance_s = allowance_s
        arrived_at = time.monotonic()
        arrivals = f"mima/arrive/{phase}"
        self.store.add(arrivals, 1)
        while True:
            self._raise_if_a_process_failed(phase, arrived_at)
            decision = self._decided(phase)
            if decision is None:
                if self.store.add(arrivals, 0) == self.world_size:
                    decision = self._claim(phase, GO)
                elif (requested := self._requested()) is not None:
                    decision = self._claim(phase, _stop_value(requested))
            if decision is not None:
                self.waits.append(time.monotonic() - arrived_at)
                if decision == DIVERGED:
                    self._learn_divergence()
                    return False
                self.stopped_by = _signal_of(decision)
                return self.stopped_by is None
            time.sleep(POLL_S)

    def report_failure(self, rank: int) -> None:
        """Tell the processes waiting at a sync that this one will not come (it raised an error)."""
        if self.store is not None:
            try:
                self.store.compare_set(FAILED, "", str(rank))
            except Exception:  # the store's host (rank 0) may be the one that failed
                pass

    def _raise_if_a_process_failed(self, phase: int, arrived_at: float) -> None:
        if self.store.check([FAILED]):
            rank = self.store.get(FAILED).decode()
            raise MimaError(f"process {rank} failed; stopping at the sync of phase {phase + 1} (see its error above)")
        if time.monotonic() - arrived_at > self.timeout_s + self.allowance_s:
            arrived = self.store.add(f"mima/arrive/{phase}", 0)
            raise MimaError(
                f"only {arrived} of {self.world_size} processes reached the sync of phase {phase + 1} within "
                f"{self.timeout_s + self.allowance_s:.0f} s (--collective_timeout {self.timeout_s:.0f} s + "
                f"{self.allowance_s:.0f} s for the steps the others had left); a process has died or hangs"
            )


def stop_store(rank: int, world_size: int, host: str, device: torch.device, timeout_s: float) -> dist.Store:
    """A key-value store for the stop protocol, of mima's own (torch.distributed.TCPStore): process 0
    serves it on a free port of `host` and tells the others the port with one broadcast; every
    process must call this at the same point (the broadcast is a collective)."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False) if rank == 0 else None
    port = torch.tensor([store.port if store is not None else 0], device=device)
    dist.broadcast(port, src=0)
    return store or dist.TCPStore(host, int(port.item()), world_size, is_master=False, timeout=timeout)
