"""Evaluation cells: each result recorded the moment it is known, so that no finished work is lost.

A cell is one (run, model, hyperparameter point, split, task) of an evaluation, e.g. (runs/N4,
"ties", {"k": 0.2, "lam": 1.1}, "val", "mnist"); its value is what the evaluation found: the
integers (correct, total), or for the run's task-vector geometry the list of pairwise cosines. The
results table is built from the cells, never from anything held in memory.

On disk (in the evaluation folder, `mima evaluate --out`):
    cells.json                   the manifest: what the cells are results of (the runs with their
                                 files' sizes and modification times, the merges, the selection,
                                 the precision, ...). A folder whose manifest differs belongs to
                                 another evaluation and is refused (or replaced with --overwrite).
    cells/<session>-p<rank>.jsonl one file per process and session, one JSON line per cell, appended
                                 and fsynced as each cell finishes.
No file is ever written by two processes, and none is locked, so the folder may sit on a shared
filesystem (Lustre, GPFS, NFS). A line cut short by a kill is ignored when reading (its cell is
simply evaluated again).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from mima.core.errors import MimaError
from mima.core.files import read_json, write_json_atomic


@dataclass(frozen=True, order=True)
class Cell:
    run: str  # the run folder, as its resolved path
    model: str  # zero_shot, fine_tuned, joint, pairwise_cos_tau or a merge name
    point: str  # the hyperparameters as canonical JSON ("{}" where there are none)
    split: str  # val, test, or "-" (pairwise_cos_tau)
    task: str  # a task name, or "-"

    def as_list(self) -> list[str]:
        return [self.run, self.model, self.point, self.split, self.task]


def point_key(hparams: Mapping[str, object]) -> str:
    """Hyperparameters as the canonical text that names a cell (sorted keys, JSON numbers)."""
    return json.dumps(dict(hparams), sort_keys=True)


class CellStore:
    """The cells of one evaluation folder: those found on disk plus those this process records."""

    MANIFEST = "cells.json"
    FOLDER = "cells"

    def __init__(self, folder: Path, session: str, rank: int) -> None:
        self.folder = Path(folder)
        self.own_file = self.folder / self.FOLDER / f"{session}-p{rank}.jsonl"
        self.values: dict[Cell, object] = {}

    @property
    def manifest_file(self) -> Path:
        return self.folder / self.MANIFEST

    @property
    def cells_dir(self) -> Path:
        return self.folder / self.FOLDER

    # ------------------------------------------------------------------ the manifest
    def prepare(self, manifest: Mapping, overwrite: bool) -> None:
        """Make the folder hold `manifest`'s cells: a new folder gets it; the same manifest keeps its
        cells; another one is refused unless `overwrite` (then its cells are removed)."""
        stored = self.read_manifest()
        if stored is not None and not same_evaluation(stored, manifest):
            if not overwrite:
                raise MimaError(f"--out {self.folder}: holds the evaluation of {describe_difference(stored, manifest)}; "
                                "give another --out, or --overwrite to replace it")
            self.clear()
        elif stored is None and self.cells_dir.is_dir() and any(self.cells_dir.iterdir()):
            self.clear()  # cells without a manifest: left by an interrupted --overwrite
        self.cells_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.manifest_file, dict(manifest))

    def read_manifest(self) -> dict | None:
        if not self.manifest_file.is_file():
            return None
        try:
            return read_json(self.manifest_file, expect=dict)
        except MimaError:
            return {}  # unreadable: differs from any real manifest

    def clear(self) -> None:
        self.manifest_file.unlink(missing_ok=True)  # first: a stop mid-way leaves no manifest over old cells
        if self.cells_dir.is_dir():
            for path in self.cells_dir.iterdir():
                path.unlink()

    # ------------------------------------------------------------------ cells
    def load(self) -> int:
        """Read every process's cells; returns how many cells are known."""
        self.values = {}
        if self.cells_dir.is_dir():
            for path in sorted(self.cells_dir.glob("*.jsonl")):
                self.values.update(read_cells(path))
        return len(self.values)

    def __contains__(self, cell: Cell) -> bool:
        return cell in self.values

    def get(self, cell: Cell):
        return self.values[cell]

    def record(self, cell: Cell, value: object) -> None:
        """Append the cell to this process's file and force it to disk before going on."""
        line = json.dumps({"cell": cell.as_list(), "value": value}) + "\n"
        self.own_file.parent.mkdir(parents=True, exist_ok=True)
        data = line.encode("utf-8")
        handle = os.open(self.own_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            size = os.fstat(handle).st_size
            rest = memoryview(data)
            while rest:  # a write cut short by a full disk or a file size limit: the next one says why
                rest = rest[os.write(handle, rest):]
            os.fsync(handle)
        except OSError as error:  # no cut line left behind, and the file named
            os.ftruncate(handle, size)
            raise OSError(error.errno, error.strerror, str(self.own_file)) from None
        finally:
            os.close(handle)
        self.values[cell] = value

    def missing(self, cells: Iterable[Cell]) -> list[Cell]:
        return [cell for cell in cells if cell not in self.values]


def read_cells(path: Path) -> dict[Cell, object]:
    """The complete lines of one cell file (a last line without its newline was cut by a kill)."""
    found: dict[Cell, object] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise MimaError(f"{path}: cannot read this cell file ({error}); remove it to evaluate its cells again") from None
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        try:
            entry = json.loads(line)
            found[Cell(*entry["cell"])] = entry["value"]
        except (ValueError, KeyError, TypeError):
            continue  # a damaged line: its cell is evaluated again
    return found


def same_evaluation(stored: Mapping, wanted: Mapping) -> bool:
    return _comparable(stored) == _comparable(wanted)


def describe_difference(stored: Mapping, wanted: Mapping) -> str:
    left, right = _comparable(stored), _comparable(wanted)
    keys = [key for key in sorted(set(left) | set(right)) if left.get(key) != right.get(key)]
    if not keys:
        return "another evaluation"
    if "runs" in keys:
        return "other runs (or runs trained again since)"
    return "another configuration (" + ", ".join(f"{key}: {left.get(key)!r} vs {right.get(key)!r}" for key in keys) + ")"


def _comparable(manifest: Mapping) -> dict:
    return {key: value for key, value in manifest.items() if key != "session"}
