"""Why do the task models of large N fall below theta_0? An ablation over the optimiser state at a
phase start, the learning rate and N (issue 12, item 4), on any `mima fit` config (default: the
offline suite, real ImageNet MobileNetV2 weights on real digit and fashion images).

Variants (each selectable in a config as written here):
  reset    model.optimizer_state: reset    fresh AdamW moments at every task segment
  keep     model.optimizer_state: keep     each task keeps its own moments across phases (the default)
  warmup   reset + model.segment_warmup_steps: W   fresh moments, the rate ramped up over the first
                                                   W steps of every segment

For every (variant, lr, N) it fits the config, then reports theta_0 with the frozen heads, each task
model on its own task (`fine_tuned`) and the uniform merge, all on the test splits; ablation.md and
ablation.json go to --out.

    python benchmarks/ablation.py                                   # configs/offline.yaml
    python benchmarks/ablation.py --iterations 1 4 8 --lr 3e-4 1e-4 --variants reset keep warmup
    python benchmarks/marks_family.py --out /tmp/marks                # a second task family of our own
    python benchmarks/ablation.py --config /tmp/marks/marks.yaml --iterations 1 4 8
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mima.core.errors import MimaError  # noqa: E402
from mima.core.files import write_json_atomic, write_text_atomic  # noqa: E402
from mima.core.run_folder import SweepFolder  # noqa: E402
from mima.services.evaluate.runs import evaluate_runs  # noqa: E402
from mima.config.run_config import load_run_config  # noqa: E402
from mima.commands.fit.run import run_fit  # noqa: E402

VARIANTS = {
    "reset": {"optimizer_state": "reset"},
    "keep": {"optimizer_state": "keep"},
    "warmup": {"optimizer_state": "reset"},  # + segment_warmup_steps from --segment-warmup
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "offline.yaml")
    parser.add_argument("--iterations", type=int, nargs="+", default=[1, 8], help="values of N")
    parser.add_argument("--lr", type=float, nargs="+", default=[3e-4, 1e-4], help="AdamW learning rates")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--segment-warmup", type=int, default=4, help="W of the warmup variant (steps)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "ablation")
    options = parser.parse_args(argv)
    try:
        base = load_run_config(options.config).as_dict()
    except MimaError as exc:
        print(f"ablation: error: {exc}", file=sys.stderr)
        return 2
    rows, started = [], time.time()
    for variant in options.variants:
        for lr in options.lr:
            label = f"{variant}_lr{lr:g}"
            sweep = SweepFolder(options.out / label)
            run_dirs = []
            for n in options.iterations:
                config = copy.deepcopy(base)
                config["model"].update(VARIANTS[variant], lr=lr, iterations=n)
                if variant == "warmup":
                    config["model"]["segment_warmup_steps"] = options.segment_warmup
                config["trainer"] = {**config.get("trainer", {}), "enable_progress_bar": False, "enable_model_summary": False}
                config.update(out=str(sweep.run(n).path), overwrite=True)
                fit_started = time.time()
                run_dirs.append(run_fit(config).run_dir)
                print(f"{label} N={n}: trained in {time.time() - fit_started:.0f} s", flush=True)
            results = evaluate_runs(run_dirs, sweep.path, ["uniform"], select_on_val=False, overwrite=True, title=label)
            by_key = {(r.N, r.model): r for r in results}
            for n in options.iterations:
                rows.append({
                    "variant": variant, "lr": lr, "N": n,
                    "theta_0": by_key[(n, "zero_shot")].mean,
                    "fine_tuned": by_key[(n, "fine_tuned")].mean,
                    "uniform": by_key[(n, "uniform")].mean,
                    "mean_cos_tau": by_key[(n, "fine_tuned")].mean_cos_tau,
                })
    write_json_atomic(options.out / "ablation.json", {"config": str(options.config), "rows": rows,
                                                     "segment_warmup": options.segment_warmup,
                                                     "seconds": round(time.time() - started)})
    lines = ["| variant | lr | N | theta_0 (%) | fine-tuned (%) | uniform (%) | mean cos(tau) |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['lr']:g} | {r['N']} | {100 * r['theta_0']:.1f} | {100 * r['fine_tuned']:.1f} | "
              f"{100 * r['uniform']:.1f} | {r['mean_cos_tau']:.3f} |" for r in rows]
    write_text_atomic(options.out / "ablation.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"ablation: {len(rows)} rows in {time.time() - started:.0f} s -> {options.out}/ablation.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
