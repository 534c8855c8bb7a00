"""The LightningModule: fine-tunes one CLIP image encoder on a process's tasks, one task per batch.

Only the image encoder is trained. Each task classifies with its own frozen zero-shot head.
The text tower is used once, to build (or read from cache) the heads, and then dropped, so no
untrained parameter reaches the optimiser or DDP.
"""

from __future__ import annotations

import time
from pathlib import Path
from dataclasses import asdict
from typing import Any

import lightning as L
from lightning.pytorch.plugins import MixedPrecision
import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

from mima.core.errors import MimaError
from mima.core.names import JOINT
from mima.models.batchnorm import BATCHNORM_CLASSES, freeze_batchnorm_statistics
from mima.models.classifier import classify
from mima.core.cache_dir import cache_dir_or_default
from mima.models.clip import LoadedClip, load_clip
from mima.models.heads import task_heads
from mima.models.stacked import StackedEncoder, clip_per_task, per_task_norms
from mima.core.layout import TaskLayout
from mima.training.lr_schedule import lr_factor
from mima.training.plan_choices import choose_compile
from mima.core.plan import PhasePlan, StepPosition
from mima.core.settings import takes_settings
from mima.config.model import ModelSettings
from mima.data.datamodule import ProcessTasks, TrainingSetup



class _Detached:
    """Holds a module without registering it as a submodule (the text tower, until heads exist)."""

    def __init__(self, value: LoadedClip | None) -> None:
        self.value = value


@takes_settings(ModelSettings)
class MimaModule(L.LightningModule):
    """MIMA fine-tuning of an open_clip image encoder. Defaults are the paper's recipe (paper 001,
    section 5: ViT-B/32, AdamW lr 1e-5, weight decay 0.1, 200 warm-up steps, cosine over S = 2000).
    Two parts of that recipe (task_vectors' fine-tuning code) live outside this module: gradients
    clipped at norm 1.0 is the Trainer's `gradient_clip_val: 1.0` (set in configs/clip/*.yaml), and
    the training split's augmentation is open_clip's training transform (`LoadedClip.preprocess_train`,
    used by the suites that read images from disk).

    Options: mima.config.model.ModelSettings (its documentation is appended below).
    """

    def __init__(self, **options: Any) -> None:
        super().__init__()
        settings = ModelSettings(**options)  # checks every option (one line per mistake)
        self.settings = settings
        # plain values in hparams, where callbacks read the run's options (set directly: Lightning's
        # save_hyperparameters would read them from this __init__'s frame, which holds `options`)
        self.hparams.update(asdict(settings))
        clip, pretrained, cache_dir = settings.clip, settings.pretrained, settings.cache_dir
        self.cache_dir = cache_dir_or_default(cache_dir)
        loaded = load_clip(clip, pretrained, cache_dir=self.cache_dir, quick_gelu=settings.quick_gelu)
        self.encoder = loaded.encoder
        if settings.grad_checkpointing is True:  # "auto": mima fit asks once its plan has decided
            self.use_grad_checkpointing()
        self.image_size = loaded.image_size
        self.preprocess = loaded.preprocess  # evaluation transform: val, test, zero-shot scoring, linear probes
        self.preprocess_train = loaded.preprocess_train  # training transform (RandomResizedCrop, as task_vectors)
        self._text = _Detached(loaded)
        # theta_0 on the CPU: task vectors are measured from it, also after resuming mid-run.
        self.theta_0 = {key: value.detach().to("cpu", copy=True) for key, value in self.encoder.state_dict().items()}
        self.plan: PhasePlan | None = None
        self.layout: TaskLayout | None = None
        self.tasks: ProcessTasks | None = None  # from TaskSuiteDataModule.connect, in setup
        self.task_names: list[str] = []
        # the running phase's start point theta_s (on the device), which the proximal term pulls towards:
        # set by MimaSyncCallback wherever the phase state's start point changes
        self.phase_start: dict[str, torch.Tensor] | None = None
        # whether a batch of the running segment came from another task's slot; a device flag read at
        # the segment end, not per step (reading it would make the host wait for the device)
        self.wrong_slot: torch.Tensor | None = None
        self.compiled = False  # model.compile: the encoder is compiled (once per process)
        # when the compiled encoder's first batch started (that step compiles), until the time is reported
        self.first_batch_started: float | None = None
        self.compile_reported = False
        # model.batch_tasks "auto" as `mima fit`'s plan settled it (a plain Trainer: off)
        self.planned_batch_tasks = False
        self.stacked: StackedEncoder | None = None  # the process's task models, with model.batch_tasks
        self.state_keys: list[str] = list(self.theta_0)  # the encoder's state_dict names (what files hold)

    # ----------------------------------------------------------------------------- setup
    def setup(self, stage: str) -> None:
        if self.plan is not None:
            return
        datamodule = self.trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "connect"):
            raise MimaError("MimaModule needs a TaskSuiteDataModule (the `data:` section of the config)")
        self.tasks = datamodule.connect(
            TrainingSetup(
                image_size=self.image_size,
                preprocess=self.preprocess,
                preprocess_train=self.preprocess_train,
                steps=self.hparams.steps,
                iterations=self.hparams.iterations,
                # which tasks this process trains: set by MimaStrategy; None for a plain one-device run
                layout=getattr(self.trainer.strategy, "layout", None),
                rank=self.trainer.global_rank,
                mode=self.hparams.mode,
                accumulate=self.trainer.accumulate_grad_batches,
                task_lengths=None if self.hparams.mode == JOINT else self.settings.task_lengths,
                batch_tasks=self.batch_tasks_resolved(),
            )
        )
        self.layout, self.plan, self.replica = self.tasks.layout, self.tasks.plan, self.tasks.shard
        self.task_names = self.tasks.task_names
        for slot, head in enumerate(self._task_heads(self.tasks.local_specs).values()):
            self.register_buffer(f"head_{slot}", head, persistent=False)
        self._text.value = None  # the text tower is no longer needed
        self.encoder.requires_grad_(True)
        if self.plan.batched:
            if any(isinstance(module, BATCHNORM_CLASSES) for module in self.encoder.modules()):
                raise MimaError(f"model.batch_tasks: the image tower of {self.settings.clip} has BatchNorm layers, whose "
                                "frozen statistics the stacked forward does not keep yet; set model.batch_tasks false")
            # the task models are the stack's slices; the encoder's module is only the code they run
            # (kept by the stack on the meta device), so no stale copy of the weights is left to read
            self.stacked = StackedEncoder(self.encoder, len(self.plan.local_tasks))
            del self.encoder
        # open_clip returns models in eval mode and Lightning keeps module modes as they are.
        self.train()

    def batch_tasks_resolved(self) -> bool:
        """model.batch_tasks as this process runs it: as given, or for "auto" what the plan chose (the
        tasks' phase lengths are checked by the plan the data module makes: one line if they differ)."""
        if self.hparams.mode == JOINT:
            return False
        given = self.settings.batch_tasks
        return given if isinstance(given, bool) else self.planned_batch_tasks

    # ------------------------------------------------------- the working model(s), by the encoder's names
    @property
    def batched(self) -> bool:
        return self.stacked is not None

    def working_state(self, slot: int = 0) -> dict[str, torch.Tensor]:
        """Slot `slot`'s working weights as the encoder's state_dict names them (views, not copies):
        the encoder's own state dict, or with model.batch_tasks the stack's slice plus its buffers."""
        if self.stacked is None:
            return self.encoder.state_dict()
        weights = self.stacked.copy_state(slot)
        buffers = {name: getattr(self.stacked, name.replace(".", "/")) for name in self.stacked.buffer_names}
        return {key: weights[key] if key in weights else buffers[key] for key in self.state_keys}

    @torch.no_grad()
    def load_working(self, state: dict[str, torch.Tensor]) -> None:
        """Every working model starts from `state` (a phase's start point), in place."""
        if self.stacked is None:
            current = self.encoder.state_dict()
            for key, value in state.items():
                current[key].copy_(value)
            return
        names = set(self.stacked.names)
        self.stacked.load_every_copy(state)
        for key, value in state.items():
            if key not in names:
                getattr(self.stacked, key.replace(".", "/")).copy_(value)

    def trained_names(self) -> set[str]:
        """The encoder's trained parameters' names."""
        if self.stacked is not None:
            return set(self.stacked.names)
        return {name for name, param in self.encoder.named_parameters() if param.requires_grad}

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimiser steps: the encoder's parameters, or the stacked ones."""
        if self.stacked is not None:
            return list(self.stacked.stacked.values())
        return [p for p in self.encoder.parameters() if p.requires_grad]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # a state stepped the other way has other tensors (stacked or not) and rounds otherwise
        saved = bool(checkpoint.get("mima", {}).get("batch_tasks", False))
        if self.plan is not None and self.hparams.mode != JOINT and saved != self.plan.batched:
            raise MimaError(f"model.batch_tasks: the run was trained with its tasks {_stepping(saved)}, and this resume "
                            f"would step them {_stepping(self.plan.batched)}; resume with --model.batch_tasks "
                            f"{str(saved).lower()}")

    def on_fit_start(self) -> None:
        # Each sync copies theta_0's trained tensors to the device for the cosine diagnostics: from
        # page-locked memory that is one DMA transfer, from pageable memory a staged copy.
        if self.device.type == "cuda":
            self.theta_0 = {key: value.pin_memory() for key, value in self.theta_0.items()}
        # Lightning turns torch's deterministic algorithms on for `trainer.deterministic: true`
        if self.stacked is None and choose_compile(self.settings.compile, self.device.type == "cuda",
                                                   torch.are_deterministic_algorithms_enabled()).value:
            self.compile_encoder()

    def compile_encoder(self) -> None:
        """torch.compile the encoder in place, once per process: its state_dict keys stay as they are,
        and every later load (a phase's average, another task's start, a resumed checkpoint) copies
        into its tensors, which the compiled code reads, so nothing is compiled again. Compiling
        happens in the first step; on_train_batch_end says how long it took."""
        if not self.compiled:
            self.encoder.compile()
            self.compiled = True

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self.compiled and self.first_batch_started is None:
            self.first_batch_started = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if self.first_batch_started is not None and not self.compile_reported:
            seconds, self.compile_reported = time.perf_counter() - self.first_batch_started, True
            if self.trainer.is_global_zero:
                print(f"mima fit: model.compile: the first step, which compiled the encoder, took {seconds:.1f} s",
                      flush=True)

    def use_grad_checkpointing(self) -> None:
        """Recompute the encoder's activations in the backward pass (model.grad_checkpointing: true,
        or "auto" where `mima fit`'s plan chose it, before training starts)."""
        _enable_grad_checkpointing(self.encoder, self.settings.clip)

    def _task_heads(self, specs) -> dict[str, torch.Tensor]:
        loaded = self._text.value
        if loaded is None:
            raise RuntimeError("heads must be built before the text tower is dropped")
        train_sets = None
        if self.hparams.heads == "linear_probe":  # fitted on theta_0: setup runs before any checkpoint loads
            train_sets = {spec.name: self.tasks.train_set(spec.name) for spec in specs}
        return task_heads(loaded, self.hparams.heads, specs, train_sets, self.cache_dir, self.tasks.data_key,
                          self.hparams.probe_shots)

    def train(self, mode: bool = True) -> MimaModule:
        """nn.Module.train, except that BatchNorm layers stay in eval mode when `batchnorm` is frozen."""
        super().train(mode)
        if mode and getattr(self, "hparams", {}).get("batchnorm") == "frozen" and getattr(self, "stacked", None) is None:
            freeze_batchnorm_statistics(self.encoder)  # (a stacked encoder has no BatchNorm layer: setup refuses one)
        return self

    def head(self, slot: int) -> torch.Tensor:
        return getattr(self, f"head_{slot}")

    # -------------------------------------------------------------------------- training
    def _prepared(self, batch):
        """With `data.cache`, a batch arrives on the device as uint8 images with crop boxes: augment and
        normalise it here, on the device, into the (images, labels, slots) of the per-image path. (Not
        in on_after_batch_transfer: Lightning warns when a module overrides it beside a datamodule.)"""
        prepare = self.tasks.prepare_batch if self.tasks is not None else None
        return prepare(batch) if prepare is not None else batch

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        batch = self._prepared(batch)
        if self.hparams.mode == JOINT:
            return self._joint_step(batch)
        if self.stacked is not None:
            return self._batched_step(batch)
        images, labels, slots = batch
        position = self.plan.position(self.global_step)
        self._check_slots(slots, position)
        logits = classify(self.encoder, self.head(position.slot), images)
        # train/loss/<task> is logged by MimaSyncCallback once per optimiser step, read from the device
        # at logging intervals; the progress bar shows the last value read (PhaseView.shown_loss)
        loss = F.cross_entropy(logits, labels)
        mu = self.hparams.proximal_mu
        if not mu:
            return loss  # MIMA's loss, untouched
        # the optimiser minimises the loss with the proximal term; the task's own loss is what is logged,
        # divided by the micro-batch count as Lightning divides "loss" (an extra key it leaves as it is)
        task_loss = loss.detach() / self.trainer.accumulate_grad_batches
        return {"loss": loss + mu / 2 * self.distance_to_phase_start(), "task_loss": task_loss}

    def distance_to_phase_start(self) -> torch.Tensor:
        """||theta - theta_s||^2 over the trained parameters (FedProx's proximal term without mu / 2),
        summed in the parameters' order, the same on every process."""
        if self.phase_start is None:
            raise RuntimeError("model.proximal_mu needs the phase's start point, which MimaSyncCallback sets")
        squares = [(param - self.phase_start[name]).square().sum()
                   for name, param in self.encoder.named_parameters() if param.requires_grad]
        return torch.stack(squares).sum()

    def _check_slots(self, slots: torch.Tensor, position: StepPosition) -> None:
        """Every batch of a segment must come from the segment's task slot: collected on the device,
        checked when the segment's last step starts (on each of its micro-batches)."""
        wrong = (slots != position.slot).any()
        self.wrong_slot = wrong if self.wrong_slot is None else self.wrong_slot | wrong
        if self.plan.ends_segment(self.global_step):
            mismatch, self.wrong_slot = bool(self.wrong_slot), None
            if mismatch:
                raise RuntimeError(f"a batch of the segment ending at step {self.global_step} does not belong to task slot "
                                   f"{position.slot}")

    def _batched_step(self, batch) -> dict:
        """model.batch_tasks: one batch per local task (the batch sampler yields them slot after slot),
        each through its own stacked model and frozen head; the optimiser minimises the sum of the
        tasks' losses, whose gradient in slice t is task t's own. The per-task losses are kept
        (divided by the micro-batch count, as Lightning divides "loss") for logging per task."""
        images, labels, slots = batch
        copies = self.stacked.copies
        images, labels = images.view(copies, -1, *images.shape[1:]), labels.view(copies, -1)
        expected = torch.arange(copies, device=slots.device).view(-1, 1)
        wrong = (slots.view(copies, -1) != expected).any()
        self.wrong_slot = wrong if self.wrong_slot is None else self.wrong_slot | wrong
        if self.plan.ends_segment(self.global_step):
            mismatch, self.wrong_slot = bool(self.wrong_slot), None
            if mismatch:
                raise RuntimeError(f"a batch of the phase ending at step {self.global_step} is not one per task slot in "
                                   "slot order")
        features = self.stacked(images)
        losses = torch.stack([F.cross_entropy(classify(torch.nn.Identity(), self.head(slot), features[slot]), labels[slot])
                              for slot in range(copies)])
        return {"loss": losses.sum(), "task_loss": losses.detach() / self.trainer.accumulate_grad_batches}

    def _joint_step(self, batch) -> torch.Tensor:
        """One forward pass over every task's batch; the mean over tasks of each task's cross-entropy."""
        images, labels, slots = batch
        features = self.encoder(images)
        losses = []
        for slot, spec in enumerate(self.tasks.local_specs):
            rows = slots == slot
            task_loss = F.cross_entropy(classify(torch.nn.Identity(), self.head(slot), features[rows]), labels[rows])
            # read by Lightning only at logging intervals (not on the progress bar, which reads every step)
            self.log(f"train/loss/{spec.name}", task_loss, on_step=True, on_epoch=False)
            losses.append(task_loss)
        return torch.stack(losses).mean()

    def learning_rate(self, process_step: int) -> float:
        """The learning rate the scheduler sets at this process step (a pure function of the plan)."""
        hp = self.hparams
        return hp.lr * lr_factor(self.plan, process_step, hp.lr_schedule, hp.schedule_scope, hp.warmup_steps,
                                 hp.segment_warmup_steps)

    def configure_optimizers(self):
        params = self.trained_parameters()
        optimizer = torch.optim.AdamW(
            params,
            lr=self.hparams.lr,
            weight_decay=self.hparams.weight_decay,
            fused=_fuse_adamw(params, self.trainer),
        )
        plan, hp = self.plan, self.hparams
        scheduler = LambdaLR(
            optimizer,
            lambda step: lr_factor(plan, step, hp.lr_schedule, hp.schedule_scope, hp.warmup_steps, hp.segment_warmup_steps),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Lightning's clipping, except with a fused AdamW: Lightning's mixed precision refuses to clip
        for any fused optimiser (for a gradient scaler's sake), but a fused AdamW is chosen only where
        no scaler runs (_fuse_adamw), so its gradients are the true ones: clipped here with the same
        torch function over the same parameters. With model.batch_tasks each task's gradients are
        clipped to the norm on their own (mima.models.stacked.clip_per_task), as one after another."""
        if gradient_clip_val and self.stacked is not None:
            params = self.trained_parameters()
            if gradient_clip_algorithm == "value":  # element by element: per task already
                torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
            else:
                clip_per_task(params, gradient_clip_val)
            return
        if not gradient_clip_val or not any(group.get("fused") for group in optimizer.param_groups):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        params = [param for group in optimizer.param_groups for param in group["params"]]
        if gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)

    # ------------------------------------------------------------------------- callbacks
    def configure_callbacks(self):
        """What a plain Trainer needs to run MIMA. `mima fit` passes its own sync (or joint) callback,
        with the checkpoint callback that reads its phase state; then only the progress bar is added
        here, after the sync callback (Lightning appends these to the Trainer's), showing the loss
        the sync callback's view of its phase state holds (none in the joint baseline)."""
        from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

        from mima.training.joint import JointFinalCallback
        from mima.training.progress import MimaProgressBar, MimaRichProgressBar
        from mima.training.sync import MimaSyncCallback
        from mima.training.sync_merge import SyncMerge

        callbacks = []
        sync = next((c for c in self.trainer.callbacks if isinstance(c, MimaSyncCallback)), None)
        if sync is None and not any(isinstance(c, JointFinalCallback) for c in self.trainer.callbacks):
            if self.hparams.mode == JOINT:
                callbacks.append(JointFinalCallback())
            else:
                sync = MimaSyncCallback(sync_merge=SyncMerge(self.hparams.sync_merge, self.hparams.sync_merge_args))
                callbacks.append(sync)
        phases = sync.phase_view() if sync is not None else None
        bar = type(self.trainer.progress_bar_callback)  # the default bars are replaced, not the user's own
        if bar is TQDMProgressBar:
            callbacks.append(MimaProgressBar(phases))
        elif bar is RichProgressBar:
            callbacks.append(MimaRichProgressBar(phases))
        return callbacks


def _stepping(batched: bool) -> str:
    return "together (batched)" if batched else "one after another"


def task_grad_norms(module: MimaModule, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The norm of each task's gradients (batched: one per slot, [L]; else the one, a scalar), or None."""
    if module.stacked is not None:
        return per_task_norms(module.trained_parameters())
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else None


def _fuse_adamw(params: list[torch.nn.Parameter], trainer: L.Trainer) -> bool | None:
    """True (one fused AdamW kernel for all parameters, its step counters kept on the device) where
    the parameters are on CUDA; None (torch's default kernels) otherwise: on the CPU fused kernels
    round differently, and CPU results are compared bit for bit. Also None with a gradient scaler
    (16-mixed) and clipping: a fused AdamW unscales the gradients itself, after the clipping would
    have seen them scaled. Without a scaler (bf16-mixed, 32-true) MimaModule clips itself
    (configure_gradient_clipping), and the fused kernel stays."""
    if not params or params[0].device.type != "cuda":
        return None
    if trainer.gradient_clip_val and _gradient_scaler(trainer) is not None:
        return None
    return True


def _gradient_scaler(trainer: L.Trainer) -> object | None:
    plugin = trainer.precision_plugin
    return plugin.scaler if isinstance(plugin, MixedPrecision) else None


def _enable_grad_checkpointing(encoder: torch.nn.Module, clip: str) -> None:
    """open_clip's switch; some towers (ModifiedResNet, custom ones) accept it and do nothing, so
    the flag it sets on the transformer or timm trunk is checked."""
    if hasattr(encoder, "set_grad_checkpointing"):
        encoder.set_grad_checkpointing(True)
    if not any(getattr(module, "grad_checkpointing", False) is True for module in encoder.modules()):
        raise MimaError(
            f"model.grad_checkpointing: the image tower of {clip} has no gradient checkpointing "
            "(open_clip offers it for ViT towers and timm models); leave it false"
        )
