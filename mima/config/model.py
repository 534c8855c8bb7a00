"""The `model:` section of a run: every option of MIMA fine-tuning, its type, its default and its other
facts (range, resume rule, value for older runs: mima.core.settings.option).

This dataclass is the one place where these options are written. MimaModule takes exactly its
fields as keyword arguments (mima.core.settings.takes_settings), so `mima fit` (LightningCLI) and
every command that reads a run config (mima.config.run_config, which imports no Lightning) parse
the same options with the same defaults, and make the same checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from mima.core.errors import MimaError
from mima.core.plan import phase_lengths, task_phase_lengths
from mima.core.names import JOINT
from mima.core.settings import (OUTER_LR_MAX, OUTER_MOMENTUM_MAX, PROXIMAL_MU_MAX, STEPS_MAX, SYNC_LAMBDA_MAX, ValueRange,
                                check_fields, option)

HeadKind = Literal["zero_shot", "linear_probe"]
ScheduleName = Literal["cosine", "constant"]
ScheduleScope = Literal["run", "phase"]
OptimizerState = Literal["reset", "keep"]
TrainingMode = Literal["mima", "joint"]  # a type spells its values; "joint" is mima.core.names.JOINT
PhaseSchedule = Literal["equal", "geometric"]
BatchNormMode = Literal["frozen", "train"]

STEP_COUNT = ValueRange(int, 1, STEPS_MAX)  # steps per task (each S_t of a map), phases, probe shots
# the hyperparameters of a sync merge that mima checks (model.sync_merge_args.NAME); another merge's
# own names are checked by the merge (mima.training.sync_merge)
SYNC_MERGE_ARGS = {
    "lam": ValueRange(float, -SYNC_LAMBDA_MAX, SYNC_LAMBDA_MAX),
    "mask_lam": ValueRange(float, -SYNC_LAMBDA_MAX, SYNC_LAMBDA_MAX, listed=True),  # one per task
    "outer_lr": ValueRange(float, 0, OUTER_LR_MAX, above_low=True),
    "outer_momentum": ValueRange(float, 0, OUTER_MOMENTUM_MAX),
}


@dataclass(frozen=True)
class ModelSettings:
    """MIMA fine-tuning of an open_clip image encoder. Defaults are the paper's recipe (paper 001,
    section 5: ViT-B/32, AdamW lr 1e-5, weight decay 0.1, 200 warm-up steps, cosine over S = 2000).

    Args:
        clip: open_clip model: an architecture name, `local-dir:PATH`, `embedded:tiny-digits` or
            `embedded:mobilenetv2-imagenet`.
        pretrained: pretrained tag or checkpoint file for an architecture name (ignored for
            `local-dir:` and `embedded:` models, which carry their weights).
        quick_gelu: the MLP activation the model is built with: true (QuickGELU, what OpenAI's CLIP
            weights were trained with), false (GELU) or "auto" (default): what the weights say. For a
            tag, its pretrained config; for a weight file, the record `mima prefetch --weights-dir`
            writes beside it or a `-quickgelu` architecture name, and otherwise the run is refused
            (a file's tensors do not say, and the wrong activation loads silently); local-dir and
            embedded folders carry their own setting.
        steps: S, optimiser steps per task over the whole run; or a map task -> S_t giving each task
            its own budget (every task of the run named once; each S_t a multiple of N): task t then
            takes K_t = S_t / N steps per phase, and the tasks are dealt to processes largest first
            so that their steps per phase are as even as possible.
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
            Measured (docs/results.md, "Phase starts"): with reset, the task models of large N end below
            theta_0 on real pretrained weights; with keep they stay above it and merge better.
        heads: "zero_shot": each task's frozen head comes from the text tower and the task's class
            names and templates (the papers); "linear_probe": a logistic regression fitted on the
            pretrained encoder's features of the task's training images (for models without a
            pretrained text tower, e.g. `embedded:mobilenetv2-imagenet`).
        batchnorm: "frozen" (default): BatchNorm layers keep theta_0's running statistics during
            fine-tuning (their weights still train), so every task model and every merge shares
            them; "train": statistics follow each task's batches (and are averaged at each sync).
            Measured on the offline suite: train-mode statistics make merges collapse (docs/data.md).
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
            more compute. "auto" (default): the run's plan decides (mima.training.plan_choices): on
            only on a GPU whose memory the plan without it would fill beyond 85 %. A tower without
            the switch is an error, not a silent no-op.
        sync_merge: the phase-end operator (mima.training.sync_merge): "uniform" (default: MIMA's
            average) or the name of any data-free merge of mima.merging (`mima merge --method`), applied to the tasks'
            end weights with theta_0 as the base at every sync; "task_arithmetic" with a fixed lam
            is ATM (arXiv 2411.03055); "outer_nesterov": DiLoCo's outer optimiser (arXiv
            2311.08105): the phase's start point minus the average is a pseudo-gradient, stepped by
            Nesterov momentum SGD (outer_lr 1 with outer_momentum 0 is the average; the momentum
            is kept from sync to sync and in checkpoints).
        sync_merge_args: that merge's hyperparameters (e.g. {lam: 0.3}); its defaults otherwise
            (outer_nesterov: {outer_lr: 0.7, outer_momentum: 0.9}, DiLoCo's).
        proximal_mu: FedProx's proximal term (arXiv 1812.06127): every step's loss adds
            mu/2 ||theta - theta_s||^2 over the trained parameters, theta_s the phase's start point,
            so each task's segment is pulled towards where the phase began; 0 (default) is MIMA.
        phase_schedule: "equal" (default): every phase K = S / N steps per task; "geometric": each
            phase `phase_ratio` times as long as the one before, the lengths summing to S
            (mima.core.plan.phase_lengths; S need not be a multiple of N).
        phase_ratio: the geometric schedule's factor (> 1: short phases first; < 1: long ones first).
        compile: compile the image encoder with torch.compile (TorchInductor) before the first step:
            true, false, or "auto" (default): on when training on a CUDA GPU, off on the CPU. The encoder
            is compiled in place once per process (its state_dict keys stay the same), and every phase,
            task and resume loads its weights into the compiled encoder, so nothing is compiled again;
            the first step pays the compile time (about 35 s for ViT-B/32 on an H200, printed once).
            At batch 128 a ViT-B/32 step is bound by kernel launches, which compiling removes (1.9x on
            an H200). Compiled kernels round differently from eager ones: a compiled run is as
            reproducible as an eager one, but not bit-identical to it (docs/configuration.md).
        batch_tasks: step the tasks a process holds together, as one model (mima.models.stacked): their
            weights stacked along a task dimension, one vmap'ed forward over a batch per task, one AdamW
            over the stacked weights (each task's learning rate, moments and gradient clipping its own),
            instead of one task after another. A phase then takes K process steps, not K per task. The
            task models equal those of the one-after-another schedule on the same batches up to
            rounding (tests/training/test_batch_tasks.py states the tolerance), not bit for bit. true, false, or
            "auto" (default): on where `mima fit`'s plan finds both on a CUDA GPU and the stacked models'
            memory fitting it, off on the CPU. Needs the process's tasks to have the same phase lengths;
            true refuses mode joint, proximal_mu > 0, batchnorm train, grad_checkpointing true and
            compile true (auto turns off there). A resume keeps the run's value.
    """

    clip: str = option("ViT-B-32")
    pretrained: str | None = option("openai")
    # the activation as a tag says; a weight file was refused before the option, or now says it
    quick_gelu: bool | Literal["auto"] = option("auto", older_runs="auto")
    steps: int | dict[str, int] = option(2000, bounds=STEP_COUNT, entries=STEP_COUNT)
    iterations: int = option(20, bounds=STEP_COUNT)
    lr: float = option(1e-5, bounds=ValueRange(float, 0, 10.0, above_low=True))
    weight_decay: float = option(0.1, bounds=ValueRange(float, 0, 100.0))
    warmup_steps: int = option(200, bounds=ValueRange(int, 0, STEPS_MAX))
    lr_schedule: ScheduleName = option("cosine")
    schedule_scope: ScheduleScope = option("run")
    optimizer_state: OptimizerState = option("keep")
    heads: HeadKind = option("zero_shot")
    batchnorm: BatchNormMode = option("frozen")
    # where the embedded models and heads are cached (the same bytes wherever they are)
    cache_dir: str | None = option(None, resume="may change")
    mode: TrainingMode = option("mima")
    segment_warmup_steps: int = option(0, bounds=ValueRange(int, 0, STEPS_MAX))
    probe_shots: int | None = option(None, bounds=STEP_COUNT)
    # the same activations, recomputed in the backward pass instead of kept
    grad_checkpointing: bool | Literal["auto"] = option("auto", resume="may change")
    sync_merge: str = option("uniform")
    sync_merge_args: dict[str, Any] | None = option(None, entries=SYNC_MERGE_ARGS)
    phase_schedule: PhaseSchedule = option("equal")
    phase_ratio: float = option(2.0, bounds=ValueRange(float, 0.01, 100.0))
    # no proximal term: MIMA's loss, as every run before the option
    proximal_mu: float = option(0.0, bounds=ValueRange(float, 0, PROXIMAL_MU_MAX), older_runs=0.0)
    # "auto" is eager on the CPU, as every run before the option was; a GPU run written before it (eager)
    # and resumed with "auto" compiles from the resume on: say --model.compile false to keep it eager
    compile: bool | Literal["auto"] = option("auto", older_runs="auto")
    # every run before the option stepped its tasks one after another: "auto" is off on the CPU, and a
    # resume's state says how the run stepped (MimaModule refuses a resume that would step otherwise)
    batch_tasks: bool | Literal["auto"] = option("auto", older_runs="auto")

    def __post_init__(self) -> None:
        self.check_ranges()
        # a map is checked against its own task names here; that they are the run's tasks, where those are known
        names = list(self.steps) if isinstance(self.steps, dict) else ["every task"]
        shortest = min(min(lengths) for lengths in self.task_lengths(names))
        if isinstance(self.steps, dict) and self.mode == JOINT:
            raise MimaError("model.steps: the joint baseline trains one model on every task at once; give one number of "
                            "steps, not a map of per-task budgets")
        if self.mode == JOINT and self.proximal_mu:
            raise MimaError("model.proximal_mu: the joint baseline has no phases, so no phase start to pull towards; "
                            "leave it 0")
        if self.batch_tasks is True:
            self.check_batch_tasks(names)
        if self.segment_warmup_steps < 0 or self.segment_warmup_steps > shortest:
            raise MimaError(
                f"model.segment_warmup_steps must be in 0 .. K = {shortest} (steps per phase, the shortest), got {self.segment_warmup_steps}"
            )

    def batch_tasks_conflict(self, tasks: list[str]) -> str | None:
        """Why this run's tasks cannot be stepped together (model.batch_tasks), or None if they can."""
        settings = [("mode", self.mode == JOINT, "the joint baseline trains one model already"),
                    ("proximal_mu", bool(self.proximal_mu), "the proximal term is not stacked yet"),
                    ("batchnorm", self.batchnorm == "train", "BatchNorm statistics are shared by the stacked models"),
                    ("grad_checkpointing", self.grad_checkpointing is True, "not under vmap yet"),
                    ("compile", self.compile is True, "the stacked forward is not compiled yet")]
        for name, conflicts, why in settings:
            if conflicts:
                return f"model.{name}={getattr(self, name)} ({why})"
        if len(set(self.task_lengths(tasks))) > 1:
            return "model.steps gives the tasks different phase lengths (the stacked tasks step together)"
        return None

    def check_batch_tasks(self, tasks: list[str]) -> None:
        conflict = self.batch_tasks_conflict(tasks)
        if conflict is not None:
            raise MimaError(f"model.batch_tasks=true does not go with {conflict}; set model.batch_tasks false (or auto)")

    def check_ranges(self) -> None:
        """Each number against its declared range (a map's entries each against theirs): before any is
        computed with."""
        check_fields("model", self)
        if self.phase_schedule == "geometric" and self.iterations > 1:
            # the longest phase is phase_ratio^(N-1) times the shortest, and no phase may be empty: past the
            # step bound (and long before a float overflows computing the power) the shortest gets no step
            spread = (self.iterations - 1) * abs(math.log(self.phase_ratio))
            if spread > math.log(STEPS_MAX):
                raise MimaError(f"model.phase_ratio={self.phase_ratio}: over model.iterations={self.iterations} phases the "
                                f"longest phase would be {self.phase_ratio}^{self.iterations - 1} times the shortest, more "
                                f"than {STEPS_MAX} steps; choose a ratio nearer 1 or fewer phases")

    def schedule_notes(self, tasks: list[str]) -> list[str]:
        """What the learning-rate schedule does that a user may not expect: a warm-up longer than the
        span it warms up (the task's S_t with `schedule_scope: run`, a phase's K with `phase`) is cut to
        that span (mima.training.lr_schedule), so the rate reaches model.lr only at the span's last step."""
        if self.mode == JOINT or self.warmup_steps <= 1:
            return []
        lengths = self.task_lengths(tasks)
        if self.schedule_scope == "run":
            span, what = min(sum(task) for task in lengths), "model.steps (S, the shortest task's)"
        else:
            span, what = min(min(task) for task in lengths), "a phase (K, the shortest)"
        if self.warmup_steps <= span:
            return []
        return [f"model.warmup_steps={self.warmup_steps} is longer than {what} = {span} steps: the warm-up is cut to "
                f"{span} steps, so the learning rate reaches model.lr={self.lr:g} only at the last step; lower "
                f"model.warmup_steps (e.g. {max(1, span // 10)}, a tenth) if that is not what you want"]

    def task_lengths(self, tasks: list[str]) -> tuple[tuple[int, ...], ...]:
        """K_1 .. K_N of each of the run's `tasks` (one budget for all, or the map's S_t)."""
        if isinstance(self.steps, dict) and not self.steps:
            raise MimaError("model.steps: an empty map; give one number of steps or one per task")
        return task_phase_lengths(self.steps, tasks, self.iterations, self.phase_schedule, self.phase_ratio)
