"""The options the analysis commands share (their model and output options). Imports nothing heavy:
`mima analyze NAME --help` and argument errors answer before torch is loaded."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelOptions:
    """What add_model_arguments declares."""

    models: tuple[Path, ...]  # one run folder, or .safetensors files
    base: Path | None  # theta_0; None: the run folder's
    config: Path | None  # the tasks, with .safetensors files

    @property
    def read_paths(self) -> list[Path]:
        """Every path the analysis reads (its output never goes into their run folders)."""
        return [*self.models, *(path for path in (self.base, self.config) if path is not None)]


@dataclass(frozen=True)
class OutputOptions:
    """What add_output_arguments declares (and every analysis has)."""

    out: Path | None  # None: the run folder's analysis folder for the analysis
    overwrite: bool


def add_model_arguments(parser: argparse.ArgumentParser, nargs: str = "+") -> None:
    parser.add_argument("models", type=Path, nargs=nargs, help="one `mima fit` run folder, or fine-tuned .safetensors files")
    parser.add_argument("--base", type=Path, help="theta_0 (pretrained .safetensors); taken from the run folder if one is given")
    parser.add_argument("--config", type=Path, help="a `mima fit` config or run folder defining the tasks (with .safetensors files)")


def add_output_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--out", type=Path, help=f"output folder (default: RUN/analysis/{name}, or analysis/{name})")
    parser.add_argument("--overwrite", action="store_true", help="replace outputs already in --out")
