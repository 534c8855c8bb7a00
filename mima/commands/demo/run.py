"""`mima demo`: the embedded default end to end, on a CPU, with nothing downloaded.

1. Load (or pretrain once and cache) the embedded tiny CLIP; zero-shot heads for the four tasks.
2. For each N in {1, 2, 4, 8} at a fixed budget S per task: `mima fit` with configs/demo.yaml
   (the one place the demo's recipe is written down, with the reasons for each value).
3. Merge each run's task models with the four strategies in COMPARED_MERGES (uniform, task arithmetic,
   TIES, CART; `--merges` picks any other data-free strategies); hyperparameters are chosen on the
   validation split (carved from train), accuracy is reported on the test split.
4. Train the joint multi-task baseline once (model.mode: joint: one encoder, every step on a batch
   of every task, the same S; `--no-joint` skips it) and add its `joint` row.
5. Write results.json / .csv / .md, selection.json and two plots; print the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mima.commands.demo import DEMO_ITERATIONS
from mima.core.errors import MimaError
from mima.evaluation.results import ModelResult
from mima.commands.sweep import run_sweep
from mima.config.run_config import load_run_config
from mima.services.evaluate.options import COMPARED_MERGES

DEMO_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"


def demo_config(steps: int | None = None, lr_schedule: str | None = None) -> dict:
    """configs/demo.yaml as a `mima fit` config dict; `steps` also rescales the warm-up to 10% of S."""
    if not DEMO_CONFIG.is_file():
        raise MimaError(f"{DEMO_CONFIG}: the demo config is missing (run mima from a checkout of the repository)")
    config = load_run_config(DEMO_CONFIG).as_dict()
    if steps is not None:
        config["model"].update(steps=steps, warmup_steps=steps // 10)
    if lr_schedule is not None:
        config["model"]["lr_schedule"] = lr_schedule
    return config


def run_demo(
    out_dir: Path,
    iterations: Sequence[int] = DEMO_ITERATIONS,
    steps: int | None = None,
    lr_schedule: str | None = None,
    select_on_val: bool = True,
    overwrite: bool = False,
    progress: bool = True,
    merges: Sequence[str] = COMPARED_MERGES,
    joint: bool = True,
    seeds: Sequence[int] | None = None,
) -> list[ModelResult]:
    """The demo sweep (`mima.commands.sweep.run_sweep` on configs/demo.yaml); `seeds`: one run per N
    and seed."""
    config = demo_config(steps, lr_schedule)
    results = run_sweep(
        config,
        out_dir,
        iterations=iterations,
        merges=merges,
        select_on_val=select_on_val,
        overwrite=overwrite,
        progress=progress,
        title="mima demo: MIMA on the embedded digits tasks",
        extra={"lr_schedule": config["model"]["lr_schedule"]},
        joint=joint,
        seeds=seeds,
    )
    print(f"One page with every table and plot: mima report {out_dir}; why the merges work: mima analyze --help")
    return results
