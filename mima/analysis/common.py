"""What the analysis commands share: their model and output options, and their output folders.

Only the commands (`mima/analysis/<name>/command.py`) use this module; the computations take state
dicts, pools and plain numbers, and the plots take the computations' results.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from mima.core.files import refuse_overwrite, write_json_atomic
from mima.core.run_folder import RunFolder, SweepFolder


def add_model_arguments(parser: argparse.ArgumentParser, nargs: str = "+") -> None:
    parser.add_argument("models", type=Path, nargs=nargs, help="one `mima fit` run folder, or fine-tuned .safetensors files")
    parser.add_argument("--base", type=Path, help="theta_0 (pretrained .safetensors); taken from the run folder if one is given")
    parser.add_argument("--config", type=Path, help="a `mima fit` config or run folder defining the tasks (with .safetensors files)")


def add_output_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--out", type=Path, help=f"output folder (default: RUN/analysis/{name}, or analysis/{name})")
    parser.add_argument("--overwrite", action="store_true", help="replace outputs already in --out")


def output_folder(out: Path | None, source: RunFolder | SweepFolder | None, name: str, files: Sequence[str],
                  overwrite: bool, create: bool = True) -> Path:
    """Resolve --out (default: the analysis folder of `source`, a run or sweep folder, else
    analysis/<name> in the working directory) and refuse to replace earlier outputs unless
    --overwrite; create the folder (with `create=False` the caller creates it once every check of its
    inputs has passed, so that a mistake found late leaves no empty folder behind)."""
    if out is not None:
        folder = Path(out)
    else:
        folder = (source if source is not None else RunFolder(Path())).analysis_dir(name)
    if not overwrite:
        refuse_overwrite([folder / file for file in files], what=f"--out {folder}", hint="pass --overwrite")
    if create:
        folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_json(path: Path, obj: object) -> None:
    write_json_atomic(path, obj)
