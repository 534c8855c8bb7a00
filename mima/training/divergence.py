"""A run whose loss (or weights) become NaN or inf stops, and writes nothing non-finite.

Where a divergence is found, without a per-step host read (the host reads the device only where
it waits for it anyway):
  * a step's loss, when the host reads the step losses (mima.training.phase_state.StepLosses: at
    logging intervals, segment ends and saves): `PhaseState.nonfinite` is the first such step;
  * the gradient norm under gradient clipping (Lightning clips by the same norm), read with the losses;
  * the weights and optimiser moments a task segment ends with, before they are kept, averaged or
    written to final/ (MimaSyncCallback), and the working state before every save (MimaCheckpoint);
    the joint baseline's weights before each save and before final/joint.safetensors (JointFinalCallback).

The process that finds it tells the others through the stop protocol (mima.training.preemption:
StopAgreement.diverge), saves nothing more, and stops after the step where it found it (at most a
logging interval after the first bad step, which is the one reported); the others stop at their
next look (saving their own, finite, states as at any stop). Every state on disk was checked
before it was written, so the last consistent cut stays a good one to resume; `mima fit` then ends
with one line naming the task, the step and that checkpoint (exit status 2). A resume whose cut
holds a NaN or inf all the same (an older mima wrote it, or the file was changed) is refused
(mima.training.resume.refuse_nonfinite).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def nonfinite_key(state: object, prefix: str = "") -> str | None:
    """The name of the first floating tensor in `state` (nested dicts and lists of tensors, as state
    dicts and optimiser states are) that holds a NaN or an inf; None when all are finite.

    First one norm over all of a device's tensors (torch's grouped norm kernels: a few launches,
    not two per tensor, and one host read): a NaN or inf anywhere makes it non-finite. Only then
    are the tensors searched one by one; a norm that overflowed on finite values (entries near the
    dtype's largest) finds nothing there and counts as finite."""
    named = [(key, value) for key, value in _floating_tensors(state, prefix)]
    by_device: dict[torch.device, list[int]] = {}
    for index, (_, value) in enumerate(named):
        by_device.setdefault(value.device, []).append(index)
    if not by_device:
        return None
    norms = [torch.nn.utils.get_total_norm([named[i][1] for i in indices]).float().cpu() for indices in by_device.values()]
    if bool(torch.stack(norms).isfinite().all()):
        return None
    first_bad: int | None = None
    for indices in by_device.values():
        finite = torch.stack([named[i][1].isfinite().all() for i in indices]).tolist()
        bad = [index for index, ok in zip(indices, finite) if not ok]
        if bad and (first_bad is None or bad[0] < first_bad):
            first_bad = bad[0]
    return None if first_bad is None else named[first_bad][0]


def _floating_tensors(state: object, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if torch.is_tensor(state):
        if state.is_floating_point() or state.is_complex():
            yield prefix or "tensor", state.detach()
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from _floating_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            yield from _floating_tensors(value, f"{prefix}.{index}" if prefix else str(index))


def divergence_report(task: str, what: str, step: int, rank: int, world_size: int) -> str:
    """What diverged, for the line `mima fit` ends with: `what` is e.g. "loss nan" or "weights
    (encoder.proj: inf)"; `step` the 0-based process step (as the step losses are logged)."""
    where = f" of process {rank}" if world_size > 1 else ""
    return f"task {task} diverged: {what} at process step {step}{where}"
