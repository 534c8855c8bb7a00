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

Needs the offline assets: `bash tests/setup_assets.sh`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


from mima.core.errors import MimaError
from mima.merging import MERGE_METHODS
from mima.sweep import run_sweep
from mima.config.run_config import load_run_config

ROOT = Path(__file__).resolve().parents[1]


def data_free_methods() -> list[str]:
    """Every registered strategy that needs neither task data nor one model per task."""
    return [name for name, method in MERGE_METHODS.items() if not method.needs_data and not method.per_task]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "offline.yaml", help="a `mima fit` config")
    parser.add_argument("--out", type=Path, default=Path("runs/offline_suite"), help="output folder")
    parser.add_argument("--iterations", type=int, nargs="+", default=[1, 2, 4, 8], help="values of N")
    parser.add_argument("--merges", nargs="+", default=None, help="merge strategies (default: every data-free one)")
    parser.add_argument("--no-select", action="store_true", help="papers' default hyperparameters, no validation search")
    probes = parser.add_mutually_exclusive_group()
    probes.add_argument("--probe-shots", type=int,
                        help="fit the linear-probe heads on this many images per class (model.probe_shots; the config's by default)")
    probes.add_argument("--full-probes", action="store_true",
                        help="fit the linear probes on up to 5000 images per task (model.probe_shots: null; strong heads)")
    parser.add_argument("--joint", action="store_true", help="also train the joint multi-task baseline (a `joint` row)")
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    options = parser.parse_args(argv)
    try:
        config = load_run_config(options.config).as_dict()  # the values `mima fit --config` would use
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
            title=f"MIMA sweep ({options.config.name})",
            extra={"config": str(options.config), "probe_shots": config["model"]["probe_shots"]},
            joint=options.joint,
        )
    except MimaError as exc:
        print(f"offline_suite: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
