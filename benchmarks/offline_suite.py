"""MIMA on the offline suite: real data (MNIST, Fashion-MNIST, scikit-learn digits and a rotated
MNIST) and a real ImageNet-pretrained MobileNetV2, on the CPU, with nothing downloaded.

For each N it runs `mima fit` with the config (same S for every N), merges the task models with
every data-free strategy (hyperparameters chosen on the validation split), evaluates on the test
split, and writes the Table-1 style table (results.md / .csv), `results.json` in the schema of
`mima demo`, selection.json and the plots (merged accuracy vs N, task-vector cosine vs N).

The task list and the model come from the config file, so the same script runs any suite, e.g. a
config whose `data.custom_tasks` name your own image folders:

    python benchmarks/offline_suite.py                                  # configs/offline.yaml
    python benchmarks/offline_suite.py --config my_tasks.yaml --iterations 1 4 --out runs/mine

With --seeds, every N is trained once per seed (seed_everything and data.seed), into
OUT/runs/N<n>-seed<s>/; the tables show the mean +- sample standard deviation over the seeds and
results.json keeps each seed's rows beside the aggregate ones. A stopped sweep resumes seed by seed
(finished (N, seed) runs are kept), and a finished one run again with more seeds trains only those:

    python benchmarks/offline_suite.py --seeds 0 1 2 --out runs/offline_seeds
    python benchmarks/offline_suite.py --config configs/offline.yaml configs/offline/t12.yaml --seeds 0 1 2  # T = 12

With --sync-merges, the sweep runs once per phase-end operator (`model.sync_merge`, e.g. `uniform
task_arithmetic ties`; `uniform` is MIMA, task_arithmetic is ATM) into OUT/sync-<name>/, and one
table compares them: (sync operator, N) x final merge, with the joint baseline (trained once,
--joint) and theta_0 as rows; OUT/sync_merges.{md,json} and OUT/sync_merges.png.

Needs the offline assets: `bash tests/setup_assets.sh`.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


from mima.core.errors import MimaError
from mima.merging import MERGE_METHODS
from mima.commands.sweep import run_sweep
from mima.config.run_config import load_run_config
from mima.config.source import read_config_file

ROOT = Path(__file__).resolve().parents[1]


def data_free_methods() -> list[str]:
    """Every registered strategy that needs neither task data nor one model per task."""
    return [name for name, method in MERGE_METHODS.items() if not method.needs_data and not method.per_task]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, nargs="+", default=[ROOT / "configs" / "offline.yaml"],
                        help="a `mima fit` config; several: later files override earlier ones, option by option "
                        "(e.g. configs/offline.yaml configs/offline/t12.yaml: the offline task family at T = 12)")
    parser.add_argument("--out", type=Path, default=Path("runs/offline_suite"), help="output folder")
    parser.add_argument("--iterations", type=int, nargs="+", default=[1, 2, 4, 8], help="values of N")
    parser.add_argument("--merges", nargs="+", default=None, help="merge strategies (default: every data-free one)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="train every N once per seed (seed_everything and data.seed), in runs/N<n>-seed<s>; "
                        "tables show mean +- std over seeds (default: one run per N, the config's seeds)")
    parser.add_argument("--no-select", action="store_true", help="papers' default hyperparameters, no validation search")
    probes = parser.add_mutually_exclusive_group()
    probes.add_argument("--probe-shots", type=int,
                        help="fit the linear-probe heads on this many images per class (model.probe_shots; the config's by default)")
    probes.add_argument("--full-probes", action="store_true",
                        help="fit the linear probes on up to 5000 images per task (model.probe_shots: null; strong heads)")
    parser.add_argument("--joint", action="store_true", help="also train the joint multi-task baseline (a `joint` row)")
    parser.add_argument("--overwrite", action="store_true", help="replace results and runs already in --out (without it, runs already there resume, finished ones are kept)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument("--sync-merges", nargs="+", default=None,
                        help="phase-end operators to compare (model.sync_merge; e.g. uniform task_arithmetic ties)")
    parser.add_argument("--sync-merge-args", type=json.loads, default={},
                        help='JSON object: hyperparameters per operator, e.g. \'{"task_arithmetic": {"lam": 0.3}}\'')
    options = parser.parse_args(argv)
    if options.sync_merges:
        return compare_sync_merges(options)
    try:
        config = suite_config(options.config)  # the values `mima fit --config` would use
        if options.probe_shots is not None or options.full_probes:
            config["model"]["probe_shots"] = options.probe_shots  # None for --full-probes
        run_sweep(
            config,
            options.out,
            iterations=options.iterations,
            merges=options.merges or data_free_methods(),
            select_on_val=not options.no_select,
            overwrite=options.overwrite,
            progress=not options.no_progress,
            title=f"MIMA sweep ({' + '.join(path.name for path in options.config)})",
            extra={"config": config_label(options.config), "probe_shots": config["model"]["probe_shots"]},
            joint=options.joint,
            seeds=options.seeds,
        )
    except MimaError as exc:
        print(f"offline_suite: error: {exc}", file=sys.stderr)
        return 2
    return 0


def suite_config(paths: Sequence[Path]) -> dict:
    """The `mima fit` config (every value, defaults included) of one config file, or of several read
    as `mima fit --config A --config B` reads them: a later file's options replace the earlier ones',
    section by section (configs/offline/t12.yaml sets only data.tasks)."""
    if len(paths) == 1:
        return load_run_config(paths[0]).as_dict()
    merged: dict = {}
    for path in paths:
        if not path.is_file():
            raise MimaError(f"--config {path}: no such file (several --config files are YAML files, not run folders)")
        for key, value in read_config_file(path, f"--config {path}").items():
            if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
                merged[key] = {**merged[key], **copy.deepcopy(dict(value))}
            else:
                merged[key] = copy.deepcopy(value)
    return load_run_config(merged).as_dict()


def config_label(paths: Sequence[Path]) -> str:
    """The config files as selection.json records them (one file: its path, as before)."""
    return " + ".join(str(path) for path in paths)


def compare_sync_merges(options) -> int:
    """One sweep per phase-end operator, then the comparison table and plot."""
    try:
        base_config = suite_config(options.config)
        if options.probe_shots is not None or options.full_probes:
            base_config["model"]["probe_shots"] = options.probe_shots
        merges = options.merges or ["uniform", "task_arithmetic", "ties", "tsv"]
        tables = {}
        for position, operator in enumerate(options.sync_merges):
            config = json.loads(json.dumps(base_config))
            config["model"]["sync_merge"] = operator
            config["model"]["sync_merge_args"] = options.sync_merge_args.get(operator) or None
            folder = options.out / f"sync-{operator}"
            # At N = 1 there is no phase-end sync (one phase from theta_0), so the operator cannot change
            # the run: N = 1 is trained once, under the first operator, and shared by the table.
            iterations = options.iterations if position == 0 else [n for n in options.iterations if n > 1]
            results = run_sweep(config, folder, iterations=iterations, merges=merges,
                                select_on_val=not options.no_select, overwrite=options.overwrite,
                                progress=not options.no_progress, title=f"MIMA sweep, sync {operator}",
                                extra={"config": config_label(options.config), "sync_merge": operator},
                                joint=options.joint and position == 0, seeds=options.seeds)
            tables[operator] = mean_over_seeds(results)
    except MimaError as exc:
        print(f"offline_suite: error: {exc}", file=sys.stderr)
        return 2
    write_sync_comparison(tables, merges, options.iterations, options.out)
    return 0


def mean_over_seeds(results) -> dict[tuple[int, str], float]:
    """Mean test accuracy per (N, model): over the seeds where the sweep has several (one run per N:
    that run's accuracy itself)."""
    by_key: dict[tuple[int, str], list[float]] = {}
    for result in results:
        by_key.setdefault((result.N, result.model), []).append(result.mean)
    return {key: statistics.fmean(values) for key, values in by_key.items()}


NO_SYNC = "any (no sync at N = 1)"


def write_sync_comparison(tables: dict[str, dict], merges: list[str], iterations: list[int], out: Path) -> None:
    """OUT/sync_merges.md/.json/.png: mean test accuracy (%) per (sync operator, N) and final merge."""
    first = next(iter(tables.values()))
    rows = []
    for position, (operator, table) in enumerate(tables.items()):
        for n in iterations:
            if n == 1 and position > 0:
                continue  # no sync at N = 1: one shared row (compare_sync_merges)
            label = NO_SYNC if n == 1 else operator
            rows.append({"sync_merge": label, "N": n, **{m: 100 * table[(n, m)] for m in ["fine_tuned", *merges]}})
    zero_shot = 100 * first[(iterations[0], "zero_shot")]
    joint = 100 * first[(iterations[0], "joint")] if (iterations[0], "joint") in first else None
    lines = ["| sync operator | N | fine-tuned | " + " | ".join(merges) + " | best merge |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in merges) + " | --- |"]
    for row in rows:
        best = max(merges, key=lambda m: row[m])
        lines.append(f"| {row['sync_merge']} | {row['N']} | {row['fine_tuned']:.1f} | "
                     + " | ".join(f"{row[m]:.1f}" for m in merges) + f" | {best} {row[best]:.1f} |")
    if joint is not None:
        lines.append(f"| joint (multi-task) | - | {joint:.1f} | " + " | ".join("" for _ in merges) + " | |")
    lines.append(f"| theta_0 | - | {zero_shot:.1f} | " + " | ".join("" for _ in merges) + " | |")
    best_per_n = []
    for n in iterations:
        candidates = [(row[m], row["sync_merge"], m) for row in rows if row["N"] == n for m in merges]
        top = max(value for value, _, _ in candidates)
        # equal accuracies (e.g. TSV = task arithmetic where no matrix is decomposed) are a tie, not a margin
        winners = [f"sync {operator} + {merge}" for value, operator, merge in candidates if value > top - 1e-6]
        others = [value for value, _, _ in candidates if value <= top - 1e-6]
        best_per_n.append({"N": n, "accuracy": top, "best": winners,
                           "margin": top - max(others) if others else None})
    lines += ["", "Best combination per N (margin over the best other accuracy at that N):"]
    lines += [f"- N={b['N']}: {' = '.join(b['best'])}: {b['accuracy']:.1f}"
              + (f" (+{b['margin']:.1f})" if b["margin"] is not None else "") for b in best_per_n]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "sync_merges.md").write_text(text)
    (out / "sync_merges.json").write_text(json.dumps({"rows": rows, "theta_0": zero_shot, "joint": joint,
                                                      "best_per_n": best_per_n}, indent=2))
    figure, axes = plt.subplots(1, len(merges), figsize=(3.2 * len(merges), 3.2), sharey=True, squeeze=False)
    for axis, merge in zip(axes[0], merges):
        for operator in tables:
            points = [(row["N"], row[merge]) for row in rows if row["sync_merge"] in (operator, NO_SYNC)]
            axis.plot([n for n, _ in points], [value for _, value in points], marker="o", label=operator)
        axis.axhline(zero_shot, color="grey", linestyle=":", label="theta_0")
        if joint is not None:
            axis.axhline(joint, color="black", linestyle="--", label="joint")
        axis.set_xscale("log", base=2)
        axis.set_xticks(iterations, [str(n) for n in iterations])
        axis.set_title(f"final merge: {merge}")
        axis.set_xlabel("N")
    axes[0][0].set_ylabel("mean test accuracy (%)")
    axes[0][-1].legend(title="sync operator", fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "sync_merges.png", dpi=120)
    plt.close(figure)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
