"""Write, for each task of a `mima fit` config, the example indices of its train, val and test splits
to OUT/<task>.json: indices into the dataset each split is read from (`from`: the task's training
split, a validation split it ships, or its test split), in the order torchvision or the folder
listing gives them. Validation is carved as task_vectors carves it (random_split,
manual_seed(data.split_seed), the permutation's tail, 10% of the training split, at most 5000).
Nothing is decoded.
"""
# `mima data splits`: each task's train/val/test example indices as JSON (mima.data.splits).

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mima.commands.common import OneLineParser, add_config_arguments, config_with_root, frozen_options
from mima.core.folders import no_empty_folder_left


@dataclass(frozen=True)
class SplitsOptions:
    config: Path
    data_root: Path | None  # --data.root; None: the config's
    out: Path  # one JSON file per task
    overwrite: bool


def parse(argv: Sequence[str]) -> SplitsOptions:
    parser = OneLineParser(prog="mima data splits", description=__doc__)
    add_config_arguments(parser)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON files (one per task)")
    parser.add_argument("--overwrite", action="store_true", help="replace split files already in --out")
    return frozen_options(SplitsOptions, parser.parse_args(argv))


def main(argv: Sequence[str]) -> None:
    options = parse(argv)
    config = config_with_root(options)
    from mima.core.files import refuse_overwrite
    from mima.core.run_outputs import refuse_output_on_runs

    refuse_output_on_runs("--out", options.out, [options.config])  # a run folder as --config stays as it is
    from mima.data.splits import task_split_record, write_split_file

    data = config.datamodule()
    seed = int(config.data.split_seed)
    if not options.overwrite:  # before any work: an earlier audit file is the user's
        refuse_overwrite([options.out / f"{spec.name}.json" for spec in data.task_specs], what=f"--out {options.out}")
    with no_empty_folder_left(options.out):
        records = [task_split_record(spec, config.data.root, seed) for spec in data.task_specs]
        options.out.mkdir(parents=True, exist_ok=True)
        for record in records:
            path = write_split_file(record, options.out)
            sizes = ", ".join(f"{split} {record[split]['size']} (of {record[split]['from']})" for split in ("train", "val", "test"))
            print(f"mima data splits: {record['task']}: {sizes} -> {path}")
