"""What the other callbacks may read of the sync callback's phase state, and the order that reading needs.

MimaSyncCallback (mima.training.sync) makes the process's PhaseState (mima.training.phase_state),
changes it, and restores it from a saved state; nobody else holds it. What the others need of it
they read through the `PhaseView` the sync callback hands out (`MimaSyncCallback.phase_view`),
given to them when they are made:

  * the checkpoint callback (mima.training.checkpoint_callback): the state a save holds
    (`state_dict`, in the layout checkpoints have always had), the phase whose average is held
    (`avg_phase`: whether the sync of the step just ended ran), the first non-finite step loss
    (`settle_losses`, `nonfinite`), what the working weights equal (`boundary`) and the host
    buffers its files are copied through and held in (`host`);
  * the progress bars and log lines (mima.training.progress): the newest loss read (`shown_loss`);
  * the tracker forwarding (mima.training.trackers): whether a sync has taken place (`avg_phase`).

Each of them reads, in a hook, what the sync callback's same hook has just changed (the loss it has
just read, the sync it has just run), so it must come after the sync callback in trainer.callbacks.
`PhaseView.check_order`, called from each reader's `setup`, refuses any other order in one line
naming both callbacks; `mima fit` builds them in that order (mima.services.fit.build).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.callbacks import Callback

from mima.core.errors import MimaError
from mima.core.plan import PhasePlan
from mima.training.phase_state import HostBuffers, PhaseState, StepLoss


class PhaseView:
    """Read access to one PhaseState, handed out by the callback that owns and changes it (`owner`;
    None: a run without phases, whose state nothing changes)."""

    def __init__(self, state: PhaseState, owner: Callback | None) -> None:
        self.state = state
        self.owner = owner

    @classmethod
    def without_phases(cls) -> PhaseView:
        """The view of a run without phases (the joint baseline): an empty state that nothing changes,
        which its checkpoints still hold, in the same layout as a MIMA run's."""
        return cls(PhaseState(), owner=None)

    @property
    def shown_loss(self) -> float | None:
        """The newest step loss logged (None before the first), for the progress bar and lines."""
        return self.state.shown_loss

    @property
    def avg_phase(self) -> int:
        """The phase whose sync made the start point held (-1: theta_0, no sync yet)."""
        return self.state.avg_phase

    @property
    def nonfinite(self) -> StepLoss | None:
        """The first step read whose loss or gradient norm is NaN or inf (read by `settle_losses`)."""
        return self.state.nonfinite

    @property
    def host(self) -> HostBuffers:
        """The host buffers the state's tensors live in: a writer copies device tensors through them
        and holds the ones it reads until it is done (HostBuffers.hold), so they are not refilled first."""
        return self.state.host

    def settle_losses(self) -> None:
        """Read the step losses the device still holds (one host-device synchronisation)."""
        self.state.settle_losses()

    def state_dict(self) -> dict:
        """The state a checkpoint holds (PhaseState.state_dict: its tensors, not copies)."""
        return self.state.state_dict()

    def boundary(self, plan: PhasePlan, step: int) -> tuple[str | int, int | None] | None:
        """What the working encoder and optimiser hold before process step `step` (PhaseState.boundary)."""
        return self.state.boundary(plan, step)

    def check_order(self, callbacks: Sequence[Callback], reader: Callback) -> None:
        """Refuse, in one line naming both, a `reader` of this view that runs before its owner in
        `callbacks` (trainer.callbacks), or without it."""
        if self.owner is None:
            return
        owner, name = type(self.owner).__name__, type(reader).__name__
        owner_at = next((index for index, callback in enumerate(callbacks) if callback is self.owner), None)
        reader_at = next((index for index, callback in enumerate(callbacks) if callback is reader), None)
        if owner_at is None:
            raise MimaError(f"trainer.callbacks: {name} reads the phase state of a {owner} that is not among them; "
                            f"add that {owner} before it")
        if reader_at is not None and reader_at < owner_at:
            raise MimaError(f"trainer.callbacks: {name} comes before {owner}, whose phase state it reads in the same "
                            f"hooks; it must come after {owner}")
