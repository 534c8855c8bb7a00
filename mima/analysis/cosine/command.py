"""`mima analyze cosine RUN... [--out DIR]`: the per-phase cosine matrices of runs, as JSON and plots.

Writes cosine.json, cosine_phases.png, cosine_heatmaps_N<n>.png per run and, for several runs,
cosine_vs_N.png, by default into RUN/analysis/cosine (or the sweep folder's analysis/cosine).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from mima.analysis.common import output_folder, write_json
from mima.analysis.cosine.compute import RunCosines, check_runs, cosine_table, run_cosines
from mima.analysis.cosine.options import NAME, CosineOptions
from mima.core.errors import MimaError
from mima.core.run_folder import RunFolder, SweepFolder


def read_run(path: Path) -> RunCosines:
    """The per-phase cosine matrices that `mima fit` logged for the run in `path`; N from its config."""
    from mima.config.run_config import load_run_config

    run = RunFolder(path)
    records = run.phase_records()
    if not records:
        raise MimaError(f"{path}: no {run.metrics_file.name} with phase records (is this a `mima fit` run folder?)")
    n = int(load_run_config(run).model.iterations) if run.config_file.is_file() else len(records)
    return run_cosines(path, n, records)


def run_folders(paths: Sequence[Path]) -> list[Path]:
    """Run folders; a sweep folder (`mima demo`, benchmarks/offline_suite.py) stands for its runs."""
    runs: list[Path] = []
    for path in paths:
        if path.is_file():
            raise MimaError(f"{path}: a file, not a folder (expected a `mima fit` run folder or a sweep folder)")
        if not path.is_dir():
            raise MimaError(f"{path}: no such folder (expected a `mima fit` run folder or a sweep folder)")
        run, sweep = RunFolder(path), SweepFolder(path)
        if run.has_metrics():
            runs.append(path)
        elif sweep.runs_dir.is_dir():
            found = sweep.runs()
            if not found:
                raise MimaError(f"{sweep.runs_dir}: no run folders with {run.metrics_file.name}")
            runs.extend(folder.path for folder in sorted(found, key=lambda folder: folder.path))
        else:
            raise MimaError(f"{path}: neither a run folder ({run.metrics_file.name}) nor a sweep folder ({sweep.runs_dir.name}/)")
    return runs


def load_runs(paths: Sequence[Path]) -> list[RunCosines]:
    return check_runs([read_run(path) for path in run_folders(paths)])


def output_files(runs: Sequence[RunCosines]) -> list[str]:
    files = [f"{NAME}.json", "cosine_phases.png"] + [f"cosine_heatmaps_N{run.n}.png" for run in runs]
    return files + (["cosine_vs_N.png"] if len(runs) > 1 else [])


def analyse(paths: Sequence[Path], out: Path | None = None, overwrite: bool = False,
            say: Callable[[str], None] = print) -> dict:
    """Read the runs, write the plots and cosine.json; return what was written to the JSON. `say` hears
    the summary lines (`mima report`, which computes it into a staging folder, keeps them to itself)."""
    from mima.analysis.cosine.plot import plot_final_vs_n, plot_heatmaps, plot_phase_boxes

    started = time.time()
    runs = load_runs([Path(path) for path in paths])
    if out is None and len(paths) > 1:
        raise MimaError("--out is needed when several folders are given")
    folder = output_folder(out, RunFolder(Path(paths[0])), NAME, output_files(runs), overwrite,
                           inputs=[*paths, *run_folders([Path(path) for path in paths])])
    for run in runs:
        plot_heatmaps(run, folder / f"cosine_heatmaps_N{run.n}.png")
    plot_phase_boxes(runs, folder / "cosine_phases.png")
    if len(runs) > 1:
        plot_final_vs_n(runs, folder / "cosine_vs_N.png")
    result = {**cosine_table(runs), "seconds": round(time.time() - started, 2)}
    write_json(folder / f"{NAME}.json", result)
    for entry in result["runs"]:
        taus = " ".join(f"{p['mean_cos_tau']:.3f}" for p in entry["phases"])
        deltas = " ".join(f"{p['mean_cos_delta']:.3f}" for p in entry["phases"])
        say(f"N={entry['N']}: mean cos(tau) per phase {taus}\n      mean cos(delta) per phase {deltas}")
    say(f"Wrote {folder} in {result['seconds']:.1f} s")
    result["folder"] = str(folder)
    return result


def main(options: CosineOptions) -> None:
    analyse(options.runs, options.out, options.overwrite)
