"""The LightningModule: fine-tunes one CLIP image encoder on a process's tasks, one task per batch.

Only the image encoder is trained. Each task classifies with its own frozen zero-shot head.
The text tower is used once, to build (or read from cache) the heads, and then dropped, so no
untrained parameter reaches the optimiser or DDP.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Literal

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

from mima.core.errors import MimaError
from mima.models.batchnorm import freeze_batchnorm_statistics
from mima.models.classifier import classify
from mima.models.clip import LoadedClip, default_cache_dir, load_clip
from mima.models.heads import HeadKind, task_heads
from mima.core.layout import TaskLayout
from mima.training.checkpointing import run_identity
from mima.training.lr_schedule import ScheduleName, ScheduleScope, lr_factor
from mima.core.plan import PhasePlan, check_budget
from mima.data.datamodule import ProcessTasks, TrainingSetup

OptimizerState = Literal["reset", "keep"]
TrainingMode = Literal["mima", "joint"]
BatchNormMode = Literal["frozen", "train"]


class _Detached:
    """Holds a module without registering it as a submodule (the text tower, until heads exist)."""

    def __init__(self, value: LoadedClip | None) -> None:
        self.value = value


class MimaModule(L.LightningModule):
    """MIMA fine-tuning of an open_clip image encoder. Defaults are the paper's recipe (paper 001,
    section 5: ViT-B/32, AdamW lr 1e-5, weight decay 0.1, 200 warm-up steps, cosine over S = 2000).
    Two parts of that recipe (task_vectors' fine-tuning code) live outside this module: gradients
    clipped at norm 1.0 is the Trainer's `gradient_clip_val: 1.0` (set in configs/clip/*.yaml), and
    the training split's augmentation is open_clip's training transform (`LoadedClip.preprocess_train`,
    used by the suites that read images from disk).

    Args:
        clip: open_clip model: an architecture name, `local-dir:PATH`, or `embedded:tiny-digits`.
        pretrained: pretrained tag or checkpoint file for an architecture name (ignored for
            `local-dir:` and `embedded:` models, which carry their weights).
        steps: S, optimiser steps per task over the whole run.
        iterations: N, the number of MIMA phases; K = S / N steps per task per phase. N = 1 is
            independent fine-tuning.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up steps (counted in per-task steps).
        lr_schedule: "cosine" (warm-up then cosine decay) or "constant" (warm-up then flat).
        schedule_scope: "run": one schedule over the task's S steps (default); "phase": restart it
            every phase over K steps.
        optimizer_state: "keep" (default): each task keeps its own AdamW moments across phases (its
            weights restart from the average, its moments go on); costs two encoder-sized buffers
            per task of the process in host memory, and in checkpoints. "reset": fresh moments for
            every task segment (SPEC 2.1's reading: each phase a new fine-tune from the average).
            Measured (README, "Phase starts"): with reset, the task models of large N end below
            theta_0 on real pretrained weights; with keep they stay above it and merge better.
        heads: "zero_shot": each task's frozen head comes from the text tower and the task's class
            names and templates (the papers); "linear_probe": a logistic regression fitted on the
            pretrained encoder's features of the task's training images (for models without a
            pretrained text tower, e.g. `embedded:mobilenetv2-imagenet`).
        batchnorm: "frozen" (default): BatchNorm layers keep theta_0's running statistics during
            fine-tuning (their weights still train), so every task model and every merge shares
            them; "train": statistics follow each task's batches (and are averaged at each sync).
            Measured on the offline suite: train-mode statistics make merges collapse (README).
        cache_dir: where the embedded models and heads are cached (default $MIMA_CACHE_DIR
            or ~/.cache/mima).
        mode: "mima" (default): MIMA as above. "joint": the joint multi-task baseline: one encoder
            trained on all tasks at once for S steps, every step on one batch of every task (each
            through its frozen head; the losses averaged), so each task sees the same examples as
            under MIMA; no phases (`iterations` is not used); on W processes plain data parallelism
            over the combined batch. Writes final/joint.safetensors.
        segment_warmup_steps: 0 (default) or a linear warm-up of the learning rate over the first
            steps of every task segment, on top of the run's schedule: with `optimizer_state: reset`
            each phase starts AdamW afresh from the average, and its first steps are taken with
            fresh (uncalibrated) second moments at the full rate.
        probe_shots: with `heads: linear_probe`, fit each probe on this many training images per
            class instead of up to 5000 images (a weaker frozen head, so that fine-tuning has more to
            add and merges can be told apart); None (default) keeps the full probe.
        grad_checkpointing: recompute the image tower's activations in the backward pass instead of
            keeping them (open_clip's `set_grad_checkpointing`: ViT towers and timm models), for
            large towers at large batches (ViT-L/14 at batch 128); the same weights, about a third
            more compute. A tower without the switch is an error, not a silent no-op.
    """

    def __init__(
        self,
        clip: str = "ViT-B-32",
        pretrained: str | None = "openai",
        steps: int = 2000,
        iterations: int = 20,
        lr: float = 1e-5,
        weight_decay: float = 0.1,
        warmup_steps: int = 200,
        lr_schedule: ScheduleName = "cosine",
        schedule_scope: ScheduleScope = "run",
        optimizer_state: OptimizerState = "keep",
        heads: HeadKind = "zero_shot",
        batchnorm: BatchNormMode = "frozen",
        cache_dir: str | None = None,
        mode: TrainingMode = "mima",
        segment_warmup_steps: int = 0,
        probe_shots: int | None = None,
        grad_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        check_budget(steps, iterations)
        if lr <= 0:
            raise MimaError(f"model.lr must be positive, got {lr}")
        if warmup_steps < 0:
            raise MimaError(f"model.warmup_steps must be >= 0, got {warmup_steps}")
        if probe_shots is not None and probe_shots < 1:
            raise MimaError(f"model.probe_shots must be a positive number of images per class, got {probe_shots}")
        if segment_warmup_steps < 0 or segment_warmup_steps > steps // iterations:
            raise MimaError(
                f"model.segment_warmup_steps must be in 0 .. K = {steps // iterations} (steps per phase), got {segment_warmup_steps}"
            )
        self.save_hyperparameters()
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        loaded = load_clip(clip, pretrained, cache_dir=self.cache_dir)
        self.encoder = loaded.encoder
        if grad_checkpointing:
            _enable_grad_checkpointing(self.encoder, clip)
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
        self.stepped = False  # whether the current batch ended with an optimiser step

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
            )
        )
        self.layout, self.plan, self.replica = self.tasks.layout, self.tasks.plan, self.tasks.shard
        self.task_names = self.tasks.task_names
        for slot, head in enumerate(self._task_heads(self.tasks.local_specs).values()):
            self.register_buffer(f"head_{slot}", head, persistent=False)
        self._text.value = None  # the text tower is no longer needed
        self.encoder.requires_grad_(True)
        # open_clip returns models in eval mode and Lightning keeps module modes as they are.
        self.train()

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
        if mode and getattr(self, "hparams", {}).get("batchnorm") == "frozen":
            freeze_batchnorm_statistics(self.encoder)
        return self

    def head(self, slot: int) -> torch.Tensor:
        return getattr(self, f"head_{slot}")

    # -------------------------------------------------------------------------- training
    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        self.stepped = False

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        # With trainer.accumulate_grad_batches > 1 most batches only accumulate gradients; the MIMA
        # callbacks act on (segment ends, checkpoints, preemption) only after a batch that stepped.
        self.stepped = True

    def _prepared(self, batch):
        """With `data.cache`, a batch arrives on the device as uint8 images with crop boxes: augment and
        normalise it here, on the device, into the (images, labels, slots) of the per-image path. (Not
        in on_after_batch_transfer: Lightning warns when a module overrides it beside a datamodule.)"""
        prepare = self.tasks.prepare_batch if self.tasks is not None else None
        return prepare(batch) if prepare is not None else batch

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        batch = self._prepared(batch)
        if self.hparams.mode == "joint":
            return self._joint_step(batch)
        images, labels, slots = batch
        position = self.plan.position(self.global_step)
        if int(slots[0]) != position.slot or bool((slots != slots[0]).any()):
            raise RuntimeError(f"batch at step {self.global_step} does not belong to task slot {position.slot}")
        logits = classify(self.encoder, self.head(position.slot), images)
        loss = F.cross_entropy(logits, labels)
        # train/loss/<task> is logged by MimaSyncCallback once per optimiser step: through self.log a
        # task's last loss would be repeated in every later row of the CSV while other tasks train
        self.log("loss", loss, on_step=True, on_epoch=False, prog_bar=True, logger=False)
        return loss

    def _joint_step(self, batch) -> torch.Tensor:
        """One forward pass over every task's batch; the mean over tasks of each task's cross-entropy."""
        images, labels, slots = batch
        features = self.encoder(images)
        losses = []
        for slot, spec in enumerate(self.tasks.local_specs):
            rows = slots == slot
            task_loss = F.cross_entropy(classify(torch.nn.Identity(), self.head(slot), features[rows]), labels[rows])
            self.log(f"train/loss/{spec.name}", task_loss, on_step=True, on_epoch=False)
            losses.append(task_loss)
        loss = torch.stack(losses).mean()
        self.log("loss", loss, on_step=True, on_epoch=False, prog_bar=True, logger=False)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(
            [p for p in self.encoder.parameters() if p.requires_grad],
            lr=self.hparams.lr,
            weight_decay=self.hparams.weight_decay,
        )
        plan, hp = self.plan, self.hparams
        scheduler = LambdaLR(
            optimizer,
            lambda step: lr_factor(plan, step, hp.lr_schedule, hp.schedule_scope, hp.warmup_steps, hp.segment_warmup_steps),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ----------------------------------------------------------------------- checkpoints
    def run_identity(self) -> dict:
        """What a checkpoint must agree on to be resumed by this run."""
        return run_identity(self.task_names, self.hparams.steps, self.plan.iterations, self.layout.world_size, self.hparams.mode)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["mima"] = {"run": self.run_identity(), "rank": self.trainer.global_rank, "rng": _capture_rng()}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get("mima")
        if saved is None:
            raise MimaError("the checkpoint was not written by `mima fit` (no 'mima' section)")
        for key, value in self.run_identity().items():
            written = saved["run"].get(key, "mima" if key == "mode" else None)  # mima 0.1 wrote no mode
            if written != value:
                raise MimaError(f"checkpoint written by a run with {key}={written}; this run has {key}={value}")
        _restore_rng(saved["rng"])

    def configure_callbacks(self):
        from lightning.pytorch.callbacks import TQDMProgressBar

        from mima.training.progress import MimaProgressBar
        from mima.training.joint import JointFinalCallback
        from mima.training.sync import MimaSyncCallback

        callbacks = [JointFinalCallback() if self.hparams.mode == "joint" else MimaSyncCallback()]
        if type(self.trainer.progress_bar_callback) is TQDMProgressBar:  # the default bar, not the user's own
            callbacks.append(MimaProgressBar())
        return callbacks


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


def _capture_rng() -> dict:
    """Every random state a step could touch, as tensors and plain values (loadable with weights_only)."""
    numpy_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [numpy_state[0], torch.from_numpy(numpy_state[1].astype(np.int64)), *numpy_state[2:]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
