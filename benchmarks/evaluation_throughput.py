"""What `mima evaluate` costs: its evaluation loop against a bare one, and the images an evaluation
forwards with and without a validation subset.

1. Throughput. The same encoder, heads, test data and precision, run side by side (alternating,
   median of --repeats): `mima` is TaskEvaluator.counts (mima.evaluation.accuracy: the loop
   `mima evaluate` runs for every cell); `bare` is a plain `for` loop over a DataLoader with the same
   batch size, counting argmax hits. Printed: images/s of each and the ratio mima / bare, and that
   both counted the same correct predictions.
2. Forward passes. For the 8-task benchmark of configs/clip/*.yaml (their split sizes below: the
   publishers' test splits, validation = min(5000, 10% of train) carved from train, or the
   dataset's own), an N sweep of --sweep runs, and the merges of --merges: the images an evaluation
   forwards, with the whole validation split for the hyperparameter grids and with
   `--val-examples K`. The count does not depend on the architecture (ViT-B/32, B/16, L/14 forward
   the same images; their cost per image differs).

    python benchmarks/evaluation_throughput.py [--config configs/demo.yaml] [--repeats 5]
        [--precision 32-true] [--val-examples 1000] [--sweep 1 2 4 8 16 20] [--precision-gap] [--json FILE]

--precision-gap adds each task's test accuracy in float32 and in bf16-mixed (on the CPU:
torch.autocast with bfloat16) of the config's theta_0, e.g. on configs/offline.yaml's real tasks;
with --gap-runs RUN_DIR ..., also of what `mima evaluate` scores in those finished runs: each
fine-tuned task model on its own task, and the uniform merge of the run's task models.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mima.evaluation.accuracy import AUTOCAST_DTYPES, EvalSettings  # noqa: E402
from mima.merging import get_method  # noqa: E402
from mima.models.classifier import classify  # noqa: E402
from mima.core.run_folder import RunFolder  # noqa: E402
from mima.pools import task_pool  # noqa: E402

# (train, validation or None: carved from train, test) of the 8-task benchmark's splits
EIGHT_TASKS = {
    "Cars": (8144, None, 8041), "DTD": (3760, None, 1880), "EuroSAT": (21600, 2700, 2700),
    "GTSRB": (26640, None, 12630), "MNIST": (60000, None, 10000), "RESISC45": (18900, 6300, 6300),
    "SUN397": (19850, None, 19850), "SVHN": (73257, None, 26032),
}
DEFAULT_MERGES = ("uniform", "task_arithmetic", "ties", "cart")
MORE_MERGES = ("tsv", "iso_c", "iso_cts", "magmax", "lines", "della")


@torch.no_grad()
def bare_counts(encoder, heads, datasets, batch_size: int, precision: str) -> dict[str, int]:
    counts = {}
    for task, dataset in datasets.items():
        correct = torch.zeros((), dtype=torch.int64)
        for images, labels in DataLoader(dataset, batch_size=batch_size):
            if precision in AUTOCAST_DTYPES:
                with torch.autocast("cpu", dtype=AUTOCAST_DTYPES[precision]):
                    features = encoder(images)
                logits = classify(torch.nn.Identity(), heads[task], features.float())
            else:
                logits = classify(encoder, heads[task], images)
            correct += (logits.argmax(dim=1) == labels).sum()
        counts[task] = int(correct)
    return counts


def throughput(config: Path, repeats: int, precision: str, batch_size: int) -> dict:
    pool = task_pool(config)
    pool.encoder.eval()
    state = {key: value.clone() for key, value in pool.encoder.state_dict().items()}
    evaluator = pool.evaluator("test", EvalSettings(precision=precision, batch_size=batch_size))
    datasets = {task: pool.splits[task].test for task in pool.tasks}
    images = sum(len(dataset) for dataset in datasets.values())
    times = {"mima": [], "bare": []}
    found = {}
    for _ in range(repeats):
        started = time.perf_counter()
        found["mima"] = {task: counts[0] for task, counts in evaluator.counts(state).items()}
        times["mima"].append(time.perf_counter() - started)
        started = time.perf_counter()
        found["bare"] = bare_counts(pool.encoder, pool.heads, datasets, batch_size, precision)
        times["bare"].append(time.perf_counter() - started)
    ratios = [bare / mima for mima, bare in zip(times["mima"], times["bare"])]
    return {
        "config": str(config), "precision": precision, "images": images, "repeats": repeats,
        "images_per_s": {name: images / statistics.median(values) for name, values in times.items()},
        "ratio_median": statistics.median(ratios), "ratios": ratios, "same_counts": found["mima"] == found["bare"],
    }


def precision_gap(config: Path, batch_size: int, runs: list[Path] = ()) -> list[dict]:
    """Rows (model, task, float32 %, bf16 %, difference in points): theta_0 of the config on every
    task; for each finished run, each task model on its own task and the uniform merge on every task."""
    pool = task_pool(config)
    models: list[tuple[str, dict, list[str]]] = [
        ("theta_0", {key: value.clone() for key, value in pool.encoder.state_dict().items()}, list(pool.tasks))]
    for run in runs:
        folder = RunFolder(run)
        finals = {task: folder.final(task) for task in folder.task_order()}
        for task, weights in finals.items():
            models.append((f"{run.name} {task} model", weights, [task]))
        models.append((f"{run.name} uniform merge", get_method("uniform").merge(list(finals.values()), folder.pretrained()).state,
                       list(finals)))
    evaluators = {precision: pool.evaluator("test", EvalSettings(precision=precision, batch_size=batch_size))
                  for precision in ("32-true", "bf16-mixed")}
    rows = []
    for label, weights, tasks in models:
        found = {precision: evaluator.counts(weights, tasks) for precision, evaluator in evaluators.items()}
        for task in tasks:
            float32, bf16 = (100 * found[p][task][0] / found[p][task][1] for p in ("32-true", "bf16-mixed"))
            rows.append({"model": label, "task": task, "float32": float32, "bf16": bf16, "difference": bf16 - float32})
    return rows


def forward_images(merges, sweep: int, val_examples: int | None) -> int:
    """Images forwarded by one evaluation of `sweep` runs of the 8 tasks with `merges`."""
    val = {task: (v if v is not None else min(5000, int(0.1 * train))) for task, (train, v, _) in EIGHT_TASKS.items()}
    if val_examples is not None:
        val = {task: min(size, val_examples) for task, size in val.items()}
    test = sum(size for _, _, size in EIGHT_TASKS.values())
    per_run = test  # each task model on its own task's test split
    for name in merges:
        method = get_method(name)
        points = 1
        for values in method.grid.values():
            points *= len(values)
        per_run += (points * sum(val.values()) if method.grid else 0) + test
    return test + sweep * per_run  # theta_0 once, then every run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo.yaml")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed", "16-mixed"))
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--val-examples", type=int, default=1000)
    parser.add_argument("--sweep", type=int, nargs="+", default=[1, 2, 4, 8, 16, 20], help="the N values (one run each)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--precision-gap", action="store_true",
                        help="also: each task's theta_0 test accuracy in float32 vs bf16-mixed (CPU autocast)")
    parser.add_argument("--gap-runs", type=Path, nargs="+", default=[],
                        help="with --precision-gap: finished runs of the config whose task models and uniform merge "
                        "are compared too (--repeats 0 measures only the gap)")
    options = parser.parse_args()
    gap = precision_gap(options.config, options.batch_size, options.gap_runs) if options.precision_gap else None
    if gap is not None:
        print("| model | task | float32 % | bf16-mixed % | difference (points) |\n| --- | --- | ---: | ---: | ---: |")
        for row in gap:
            print(f"| {row['model']} | {row['task']} | {row['float32']:.2f} | {row['bf16']:.2f} | {row['difference']:+.2f} |")
        if options.repeats == 0:
            if options.json:
                options.json.write_text(json.dumps({"precision_gap": gap}, indent=2))
            return

    measured = throughput(options.config, options.repeats, options.precision, options.batch_size)
    print(f"evaluation loop, {measured['images']} test images, {options.precision}, {options.repeats} repeats")
    print("| loop | images/s |\n| --- | ---: |")
    for name, rate in measured["images_per_s"].items():
        print(f"| {name} | {rate:.0f} |")
    spread = ", ".join(f"{r:.3f}" for r in measured["ratios"])
    print(f"mima / bare: {measured['ratio_median']:.3f} (median; repeats {spread}); same counts: {measured['same_counts']}")

    runs = len(options.sweep)
    rows = []
    for label, merges in (("default merges", DEFAULT_MERGES), ("+ tsv, iso_c, iso_cts, magmax, lines, della", DEFAULT_MERGES + MORE_MERGES)):
        whole = forward_images(merges, runs, None)
        subset = forward_images(merges, runs, options.val_examples)
        rows.append({"merges": label, "whole_val": whole, "val_examples": subset, "ratio": subset / whole})
    print(f"\nimages forwarded, 8 tasks, N in {options.sweep} ({runs} runs), validation whole vs "
          f"--val-examples {options.val_examples}")
    print("| merges | whole validation | subset | subset / whole |\n| --- | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['merges']} | {row['whole_val'] / 1e6:.2f} M | {row['val_examples'] / 1e6:.2f} M | {row['ratio']:.2f} |")
    if options.json:
        options.json.write_text(json.dumps({"throughput": measured, "forward_images": rows, "precision_gap": gap}, indent=2))


if __name__ == "__main__":
    main()
