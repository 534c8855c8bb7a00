"""MimaStrategy: Lightning's DDP, made task-parallel.

What plain DDP gets wrong for MIMA, and what this strategy does instead:
  * DDP all-reduces gradients over every process, mixing tasks. Here each task's replicas form
    their own process group and only those are wrapped in DistributedDataParallel; a process
    that is alone with its tasks is not wrapped at all (it has no gradient to share).
  * Lightning saves rank 0's state only, but every process holds different task weights. Here
    every process saves its own state, when it chooses, without collectives (MimaCheckpoint), and
    each loads its own state of the consistent cut chosen at start-up
    (mima.training.resume.choose_resume).
  * Lightning broadcasts a "SIGTERM seen" flag from rank 0 before every training step. Processes
    that own different numbers of tasks take different numbers of steps between syncs, so that
    broadcast would pair up unrelated steps and deadlock; stop requests go through
    mima.training.preemption instead, and the broadcast is switched off.
  * A collective that waits for a dead process would hang; the process-group timeout
    (`timeout_s`) bounds it.
  * The stop protocol needs a key-value store shared by the processes: the strategy serves one of
    mima's own from process 0 (mima.training.preemption.stop_store) and connects the StopAgreement.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from mima.config.defaults import COLLECTIVE_TIMEOUT_S
from mima.core.errors import MimaError
from mima.core.layout import TaskLayout
from mima.training.checkpoint_format import expand
from mima.training.elastic import redealt_state, set_aside
from mima.training.preemption import StopAgreement, stop_store
from mima.training.resume import RunStart


class MimaStrategy(DDPStrategy):
    """Task-parallel DDP for MimaModule.

    Args:
        num_tasks: T, the number of tasks of the run (`mima fit` gives it from the data config).
        timeout_s: seconds a collective may wait for the other processes before the run fails.
        stop: this process's side of the stop protocol (made by `mima fit`; connected here once the
            process group exists). None: stop requests are ignored.
        task_work: each task's budget S_t, by which tasks are dealt to processes (TaskLayout.work;
            empty: by count).
        run_start: the cut each process loads its state from (mima.training.resume.RunStart, filled
            by `mima fit` before training starts). None: no resume.
        cluster_environment: Lightning's (None: the one Lightning detects).
        **ddp_options: keyword arguments of DistributedDataParallel for the replicas of a task.
    """

    def __init__(self, num_tasks: int = 1, timeout_s: int = COLLECTIVE_TIMEOUT_S, stop: StopAgreement | None = None,
                 task_work: tuple[int, ...] = (), run_start: RunStart | None = None,
                 cluster_environment: ClusterEnvironment | None = None, **ddp_options: Any) -> None:
        super().__init__(cluster_environment=cluster_environment, timeout=timedelta(seconds=timeout_s), **ddp_options)
        self.num_tasks = num_tasks
        self.task_work = tuple(task_work)
        self.timeout_s = timeout_s
        self.ddp_options = ddp_options
        self.stop = stop
        self.run_start = run_start if run_start is not None else RunStart()
        self.layout: TaskLayout | None = None
        self.task_group = None

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        self.layout = TaskLayout(self.num_tasks, self.world_size, self.task_work)
        if self.layout.replicas > 1:
            self.task_group, _ = dist.new_subgroups_by_enumeration(self.layout.task_group_ranks())
        if self.stop is not None:
            store = None
            if self.world_size > 1:
                store = stop_store(self.global_rank, self.world_size, self.cluster_environment.main_address,
                                   self.root_device, self.timeout_s)
            self.stop.connect(self.world_size, self.task_group, self.root_device, store)

    @override
    def setup(self, trainer: lightning.pytorch.Trainer) -> None:
        super().setup(trainer)
        # Lightning broadcasts a "SIGTERM seen" flag from rank 0 before every training step.
        # Processes that own different numbers of tasks take different numbers of steps between
        # syncs, so that broadcast would pair unrelated steps and deadlock; stop requests go through
        # mima.training.preemption instead. Lightning offers no public switch for this broadcast
        # (an open proposal, Lightning PR #21640, adds `broadcast_sigterm_every_n_steps`): this is the
        # one private Lightning name mima still touches (tests/architecture/test_private_access.py lists it).
        epoch_loop = trainer.fit_loop.epoch_loop
        if not callable(getattr(epoch_loop, "_broadcast_sigterm_tensor", None)):
            # a Lightning whose loop changed: the broadcast may be elsewhere now, and would deadlock
            raise MimaError(
                f"lightning {lightning.__version__}: its training loop no longer has the per-step SIGTERM broadcast "
                "that mima switches off; install a tested release (pip install 'lightning>=2.6,<2.7')"
            )
        epoch_loop._broadcast_sigterm_tensor = lambda: None

    @override
    def configure_ddp(self) -> None:
        """Wrap the module in DDP over its task's replicas only; a process alone with its tasks is not
        wrapped (it has no gradient to share with anyone)."""
        if self.layout is None or self.layout.replicas == 1:
            return
        self.model = DistributedDataParallel(module=self.model, device_ids=self.determine_ddp_device_ids(),
                                             process_group=self.task_group, **self.ddp_options)

    @override
    def teardown(self) -> None:
        super().teardown()
        # mima only fits: release the process group (and its port) so that a later fit in the same
        # Python process, such as the next N of `mima demo`, starts from a clean slate.
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None) -> None:
        raise MimaError("mima saves checkpoints with MimaCheckpoint (each process its own); trainer.save_checkpoint is not supported")

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """This process's state of the cut chosen by `mima fit`, with its file references resolved; a
        cut saved by another number of processes is re-dealt (mima.training.elastic). Every process
        loads here, so states of other layouts are set aside only once all have loaded theirs."""
        cut = self.run_start.cut
        run_dir = Path(checkpoint_path).parent
        redeal = getattr(cut, "redeal", None)
        if redeal is not None:
            state = redealt_state(redeal, self.global_rank, run_dir, self.lightning_module,
                                  self.lightning_module.trainer.accumulate_grad_batches)
        elif not cut or self.global_rank not in cut:
            raise MimaError(f"--ckpt_path {checkpoint_path}: no state chosen for process {self.global_rank}")
        else:
            state = expand(torch.load(cut[self.global_rank], map_location="cpu", weights_only=True), run_dir)
        if getattr(cut, "set_aside", None):
            self.barrier("mima: every process has loaded its state")
            if self.global_rank == 0:
                set_aside(run_dir, cut.set_aside)
            self.barrier("mima: other layouts set aside")
        return state

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        pass  # MimaCheckpoint removes what it no longer needs
