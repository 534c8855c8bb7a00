"""Where one process stands in MIMA's phases.

`PhaseState` holds what a process carries from one task segment to the next and across a sync:
the phase's start point `avg`, each of its task slots' end weights of the running phase, the
kept AdamW moments (`optimizer_state: keep`), the outer momentum of `sync_merge: outer_nesterov`,
the per-slot loss sums, and whether a sync is pending (a stop came at a sync, before it ran).
Its one owner is MimaSyncCallback (mima.training.sync), which makes it, changes it and restores it
from a saved state. The other callbacks read it through the view that callback hands out
(mima.training.phase_view): the checkpoint callback what a save holds (`state_dict`, the layout
of mima's "phase_state" section of every saved state), the progress bars the newest logged loss,
which the host has read anyway (`shown_loss`), the tracker forwarding whether a sync took place.

The end weights and kept moments live in host memory, in `HostBuffers`: one buffer per (kind,
slot), reserved before the first step (`PhaseState.reserve`) and refilled at every segment end
(pinned when the tensors come from a CUDA device, so the copy is asynchronous), never a new
allocation per segment.

`StepWatch` tells a callback whether the batch that just ended also ended an optimiser step (with
`trainer.accumulate_grad_batches` > 1 most batches only accumulate gradients); each callback keeps
its own, from the public step counter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from mima.core.plan import PhasePlan
from mima.training.checkpoint_format import flatten_moments, unflatten_moments

StateDict = dict[str, torch.Tensor]
Moments = dict[int, dict]  # an optimiser's per-parameter state: {param: {"step", "exp_avg", "exp_avg_sq"}}
BufferName = tuple[str, int]  # (what it holds: "segment", "moments", ..., slot or task)


PINNED_ALIGNMENT = 512  # bytes: where each tensor carved from a page-locked block starts
LARGEST_BLOCK = 256 * 2**20  # bytes: larger buffers take several blocks (a larger tensor, one of its own)


def _power_of_two_at_least(size: int) -> int:
    return 1 << max(size - 1, 0).bit_length()


def _aligned(size: int) -> int:
    return -(-size // PINNED_ALIGNMENT) * PINNED_ALIGNMENT


class HostArena:
    """Host tensors carved from large blocks. torch's page-locked memory allocator rounds every
    request up to a power of two (a 9.4 MB weight matrix takes 16 MB, locked in RAM); here blocks
    are asked for in powers of two, at most `largest_block` unless one tensor needs more, sized
    for the buffer being filled, and filled tensor after tensor: the memory lost is what is left at
    the end of each block (less than one tensor) and of the newest one. `pinned=False` (ordinary
    memory) for tests of the carving on a machine without a GPU."""

    def __init__(self, pinned: bool = True, largest_block: int = LARGEST_BLOCK) -> None:
        self.pinned = pinned
        self.largest_block = largest_block
        self.block: torch.Tensor | None = None  # uint8
        self.used = 0  # bytes of `block` given out
        self.blocks = 0  # blocks allocated so far
        self.reserved = 0  # their bytes

    def tensor(self, shape: torch.Size, dtype: torch.dtype, wanted: int = 0) -> torch.Tensor:
        """An uninitialised tensor; `wanted`: the bytes this one and the ones about to follow need
        (`space_for`), for the size of a new block if one is needed."""
        size = shape.numel() * dtype.itemsize
        if self.block is None or self.used + size > self.block.numel():
            block_size = _power_of_two_at_least(max(size, min(wanted, self.largest_block)))
            self.block = torch.empty(block_size, dtype=torch.uint8, pin_memory=self.pinned)
            self.used = 0
            self.blocks += 1
            self.reserved += block_size
        carved = self.block[self.used:self.used + size].view(dtype).view(shape)
        self.used = _aligned(self.used + size)
        return carved

    @staticmethod
    def space_for(tensors: Iterable[torch.Tensor]) -> int:
        """The bytes `tensor` gives these tensors, alignment included."""
        return sum(_aligned(value.numel() * value.element_size()) for value in tensors)


@dataclass(frozen=True)
class TensorSpec:
    """What a host buffer entry holds: shape and dtype, and whether it is filled from a GPU."""

    shape: torch.Size
    dtype: torch.dtype
    from_gpu: bool

    @staticmethod
    def like(value: torch.Tensor) -> TensorSpec:
        return TensorSpec(value.shape, value.dtype, value.device.type == "cuda")


def adamw_moment_specs(optimizer: torch.optim.Optimizer) -> dict[str, TensorSpec]:
    """The flat moments (mima.training.checkpoint_format.flatten_moments) that AdamW will hold once it
    has stepped, from its parameters: "step" (a float32 scalar, on the parameters' device when the
    optimiser is fused or capturable, on the CPU otherwise), "exp_avg" and "exp_avg_sq" like the
    parameter (and "max_exp_avg_sq" with amsgrad)."""
    specs: dict[str, TensorSpec] = {}
    index = 0
    for group in optimizer.param_groups:
        names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else [])
        step_on_device = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            on_gpu = param.device.type == "cuda"
            specs[f"{index}.step"] = TensorSpec(torch.Size([]), torch.float32, on_gpu and step_on_device)
            for name in names:
                specs[f"{index}.{name}"] = TensorSpec(param.shape, param.dtype, on_gpu)
            index += 1
    return specs


class HostBuffers:
    """Host copies of device tensors in buffers allocated once per name and reused.

    `fill` copies with `non_blocking=True`: from a CUDA device into page-locked memory the copy is
    queued on the current stream behind the work that produced the tensors, and the host goes on.
    Everything the device reads from a buffer later (the averaging, a kept task's moments going back
    into the optimiser) is queued on the same stream, so it sees the copy; the host itself waits
    only where it reads a buffer (`ready`: the checkpoint writer, the final files).

    The checkpoint writer writes buffers as they are, on its own thread, after the training thread
    has moved on; a buffer must not be refilled before that write is done. Whoever hands a buffer to
    such a reader says how to wait for it (`hold`); the next `fill` of that buffer waits first.
    """

    def __init__(self) -> None:
        self.buffers: dict[BufferName, StateDict] = {}
        self.readers: dict[BufferName, Callable[[], None]] = {}  # name -> wait until its pending reader is done
        self.copied: torch.cuda.Event | None = None  # recorded after the newest copies from a CUDA device
        self.allocations = 0  # host tensors allocated so far (each buffer's, once)
        self.page_locked = HostArena()  # where copies of CUDA tensors go

    def fill(self, name: BufferName, tensors: Mapping[str, torch.Tensor]) -> StateDict:
        """Buffer `name` holding a copy of `tensors` (once its pending reader is done with it)."""
        reader = self.readers.pop(name, None)
        if reader is not None:
            reader()
        filled, wanted = {}, HostArena.space_for(tensors.values())  # a new pinned block takes the rest of the buffer
        for key, value in tensors.items():
            filled[key] = self.stage(name, key, value, wanted)
            wanted -= HostArena.space_for([value])
        for device in {value.device for value in tensors.values()}:
            self.copies_queued(device)
        return filled

    def stage(self, name: BufferName, key: str, value: torch.Tensor, wanted: int = 0) -> torch.Tensor:
        """Copy one tensor into entry `key` of buffer `name` (allocated on first use, or when the
        tensor's shape or dtype changed; `wanted` as in HostArena.tensor); `copies_queued` after the
        last one from a device. Unlike `fill`, it does not wait for a reader: for buffers only their
        filler reads."""
        target = self.entry(name, key, TensorSpec(value.shape, value.dtype, value.device.type == "cuda"), wanted)
        with torch.no_grad():
            target.copy_(value, non_blocking=True)
        return target

    def entry(self, name: BufferName, key: str, spec: TensorSpec, wanted: int = 0) -> torch.Tensor:
        """Entry `key` of buffer `name`, allocated as `spec` says unless it already is (page-locked for
        copies from a GPU: `spec.from_gpu`)."""
        buffer = self.buffers.setdefault(name, {})
        target = buffer.get(key)
        if target is None or target.shape != spec.shape or target.dtype != spec.dtype:
            if spec.from_gpu:  # page-locked: the copy from the device is asynchronous
                target = self.page_locked.tensor(spec.shape, spec.dtype, wanted)
            else:
                target = torch.empty(spec.shape, dtype=spec.dtype)
            buffer[key] = target
            self.allocations += 1
        return target

    def reserve(self, name: BufferName, specs: Mapping[str, TensorSpec]) -> None:
        """Allocate buffer `name` for tensors like `specs` now (before training starts), so that its
        fills at segment ends find it ready: page-locked allocations (cudaHostAlloc) are slow and
        synchronise the device, not something to do between two steps."""
        wanted = sum(_aligned(spec.shape.numel() * spec.dtype.itemsize) for spec in specs.values())
        for key, spec in specs.items():
            self.entry(name, key, spec, wanted)
            wanted -= _aligned(spec.shape.numel() * spec.dtype.itemsize)

    def copies_queued(self, device: torch.device) -> None:
        """Mark the copies queued so far from `device`, for `ready` (nothing to mark off a GPU)."""
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self.copied = event

    def hold(self, name: BufferName, until_read: Callable[[], None]) -> None:
        """A reader that is not done yet has buffer `name`: `until_read()` returns once it is, and runs
        before the buffer is filled again."""
        self.readers[name] = until_read

    def ready(self) -> Callable[[], None]:
        """A wait (for any thread) until the copies queued so far have reached host memory."""
        event = self.copied
        return event.synchronize if event is not None else _nothing_to_wait_for

    def wait(self) -> None:
        """Wait here until the copies queued so far are in host memory."""
        self.ready()()


def _nothing_to_wait_for() -> None:
    return None


@dataclass(frozen=True)
class StepLoss:
    """One optimiser step's loss as the host reads it: the sum of its micro-batches' losses; with
    gradient clipping, also the norm of the gradients it stepped with (None: not measured)."""

    step: int
    slot: int
    value: float
    grad_norm: float | None = None

    @property
    def finite(self) -> bool:
        return math.isfinite(self.value) and (self.grad_norm is None or math.isfinite(self.grad_norm))

    def nonfinite_part(self) -> str:
        """What is not finite, for the line a diverged run ends with: "loss nan", "gradient norm inf"."""
        if not math.isfinite(self.value):
            return f"loss {self.value}"
        return f"gradient norm {self.grad_norm}"


class StepLosses:
    """The losses of the steps the host has not read yet, kept as device tensors (one per
    micro-batch), and read all at once by `settle` with a single device-to-host copy."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, int, list[torch.Tensor]]] = []  # (step, slot, micro-batch losses)
        self.micro_batches: list[torch.Tensor] = []  # of the running step
        self.grad_norms: dict[tuple[int, int], torch.Tensor] = {}  # (step, slot) -> its gradient norm (under clipping)
        self.grad_norm: torch.Tensor | None = None  # of the running step

    def add_micro_batch(self, loss: torch.Tensor) -> None:
        self.micro_batches.append(loss.detach())

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        """The running step's gradient norm, kept on the device like its losses."""
        self.grad_norm = norm.detach()

    def end_step(self, step: int, slot: int) -> None:
        self.pending.append((step, slot, self.micro_batches))
        self.micro_batches = []
        if self.grad_norm is not None:
            self.grad_norms[(step, slot)] = self.grad_norm
            self.grad_norm = None

    def end_batched_step(self, step: int, slots: int) -> None:
        """A step of `slots` tasks at once (model.batch_tasks): every micro-batch loss, and the gradient
        norm, holds one value per slot ([slots]); each slot's becomes a step loss of its own."""
        for slot in range(slots):
            self.pending.append((step, slot, [loss[slot] for loss in self.micro_batches]))
            if self.grad_norm is not None:
                self.grad_norms[(step, slot)] = self.grad_norm[slot]
        self.micro_batches, self.grad_norm = [], None

    def settle(self) -> list[StepLoss]:
        """The pending steps' losses as floats. Summed on the host in float64, micro-batch by
        micro-batch, as `float(loss)` per micro-batch summed them: the logged values stay the same."""
        if not self.pending:
            return []
        measured = [(step, slot) for step, slot, _ in self.pending if (step, slot) in self.grad_norms]
        norms = [self.grad_norms[key] for key in measured]
        # one device-to-host copy for the losses and the gradient norms (after them)
        flat = torch.stack([loss.float() for _, _, losses in self.pending for loss in losses]
                           + [norm.float() for norm in norms]).tolist()
        read_norms = dict(zip(measured, flat[len(flat) - len(norms):]))
        settled, index = [], 0
        for step, slot, losses in self.pending:
            total = 0.0
            for value in flat[index:index + len(losses)]:
                total += value
            index += len(losses)
            settled.append(StepLoss(step, slot, total, read_norms.get((step, slot))))
        self.pending, self.grad_norms = [], {}
        return settled


@dataclass
class PhaseState:
    """One process's phase state (see the module docstring), held by its MimaSyncCallback alone."""

    avg: StateDict = field(default_factory=dict)  # the running phase's start point (on the device)
    avg_phase: int = -1  # `avg` is the average after the sync ending this phase (-1: theta_0)
    segment_ends: dict[int, StateDict] = field(default_factory=dict)  # slot -> end weights (host buffers)
    segment_phase: int = 0  # the phase `segment_ends` belong to
    task_moments: dict[int, Moments] = field(default_factory=dict)  # slot -> AdamW state (host buffers)
    moments_phase: dict[int, int] = field(default_factory=dict)  # slot -> phase whose segment end they are
    loss_sums: dict[int, float] = field(default_factory=dict)  # slot -> summed step losses this phase (settled ones)
    step_losses: StepLosses = field(default_factory=StepLosses)  # on the device, not yet in loss_sums
    unlogged: list[StepLoss] = field(default_factory=list)  # settled, not yet written to the loggers
    # model.sync_merge: outer_nesterov: the outer momentum after the sync ending phase `avg_phase` (on the
    # device; the same on every process); empty before the first sync and for every other operator
    outer_momentum: StateDict = field(default_factory=dict)
    pending_sync: bool = False  # stopped at a sync before entering it: run it first on resume
    step_seconds: float | None = None  # this process's median step time (how long its syncs wait; not the weights)
    restored: bool = False  # loaded from a checkpoint (not a fresh start)
    shown_loss: float | None = None  # the newest step loss logged, for the progress bar (not saved)
    nonfinite: StepLoss | None = None  # the first step read whose loss or gradient norm is NaN or inf (not saved)
    host: HostBuffers = field(default_factory=HostBuffers)  # the memory segment_ends and task_moments live in

    def keep_segment_end(self, slot: int, phase: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Keep a task slot's end weights of `phase` (copied into the slot's host buffer)."""
        self.segment_ends[slot] = self.host.fill(("segment", slot), weights)
        self.segment_phase = phase

    def keep_moments(self, slot: int, phase: int, optimizer_state: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """Keep a task slot's optimiser moments at the end of its segment of `phase` (copied into the
        slot's host buffer, in the optimiser's order)."""
        self.task_moments[slot] = unflatten_moments(self.host.fill(("moments", slot), flatten_moments(optimizer_state)))
        self.moments_phase[slot] = phase

    def reserve(self, slots: int, encoder_state: Mapping[str, torch.Tensor], moments: Mapping[str, TensorSpec] | None) -> None:
        """Allocate, before the first step, the host buffers of `slots` task slots: end weights like
        `encoder_state` and, where moments are kept (`moments`), AdamW moments like those."""
        weights = {key: TensorSpec.like(value) for key, value in encoder_state.items()}
        for slot in range(slots):
            self.host.reserve(("segment", slot), weights)
            if moments is not None:
                self.host.reserve(("moments", slot), moments)

    def forget_moments(self, slot: int) -> None:
        """A task slot has no later segment: nothing of its moments is kept (its buffer stays for reuse)."""
        self.task_moments.pop(slot, None)
        self.moments_phase.pop(slot, None)

    @property
    def completed_syncs(self) -> int:
        return self.avg_phase + 1

    def boundary(self, plan: PhasePlan, step: int) -> tuple[str | int, int | None] | None:
        """What the working encoder and optimiser hold before process step `step`, if they equal
        tensors of this state: ("avg", slot whose kept moments the optimiser holds, or None) at the
        start of a segment; (slot, None) at a pending sync (the last segment's end weights); None
        inside a segment."""
        if plan.batched:
            return None  # the stacked models and their moments are saved as they are (no per-slot files yet)
        if self.pending_sync:
            return len(plan.local_tasks) - 1, None
        if step >= plan.local_steps or not plan.position(step).starts_segment:
            return None
        slot = plan.position(step).slot
        return "avg", slot if slot in self.task_moments else None

    def settle_losses(self) -> None:
        """Read the pending step losses (one host-device synchronisation) into `loss_sums`; they
        wait in `unlogged` for the loggers."""
        for settled in self.step_losses.settle():
            self.loss_sums[settled.slot] = self.loss_sums.get(settled.slot, 0.0) + settled.value
            self.unlogged.append(settled)
            if self.nonfinite is None and not settled.finite:
                self.nonfinite = settled  # the run stops (mima.training.divergence)

    def take_unlogged(self) -> list[StepLoss]:
        """Every step loss not yet logged, settled, in step order; forgotten here."""
        self.settle_losses()
        rows, self.unlogged = self.unlogged, []
        return rows

    def state_dict(self) -> dict:
        """The tensors themselves (no copies): the checkpoint code stores each once as a file and
        keeps a reference; the phases say which file. The host buffers' copies from a GPU may still
        be in flight: a reader waits with `host.ready()` first, and tells `host.hold` until when it
        reads them. A save is a synchronisation point anyway: the pending step losses are settled
        into `loss_sums` first (and logged later)."""
        self.settle_losses()
        return {
            "avg": self.avg,
            "avg_phase": self.avg_phase,
            "segment_ends": dict(self.segment_ends),
            "segment_phase": self.segment_phase,
            "task_moments": dict(self.task_moments),
            "moments_phase": dict(self.moments_phase),
            "loss_sums": dict(self.loss_sums),
            "pending_sync": self.pending_sync,
            "step_seconds": self.step_seconds,
            "outer_momentum": self.outer_momentum,
        }

    def load_state_dict(self, state: dict) -> None:
        self.avg = state["avg"]
        self.avg_phase = int(state["avg_phase"])
        self.segment_ends = {int(slot): weights for slot, weights in state["segment_ends"].items()}
        self.segment_phase = int(state["segment_phase"])
        self.loss_sums = {int(slot): value for slot, value in state["loss_sums"].items()}
        self.task_moments = {int(slot): moments for slot, moments in state["task_moments"].items()}
        self.moments_phase = {int(slot): int(phase) for slot, phase in state["moments_phase"].items()}
        self.pending_sync = bool(state["pending_sync"])
        self.step_seconds = state.get("step_seconds")  # absent in states saved before it was kept
        self.outer_momentum = dict(state.get("outer_momentum") or {})  # absent before the outer optimiser
        self.restored = True


class StepWatch:
    """Whether the batch that just ended stepped the optimiser: Lightning's step counter
    (`trainer.global_step`) counts optimiser steps, so it moved during the batch exactly then."""

    def __init__(self) -> None:
        self.steps_before = -1

    def batch_starts(self, global_step: int) -> None:
        self.steps_before = global_step

    def stepped(self, global_step: int) -> bool:
        return global_step != self.steps_before
