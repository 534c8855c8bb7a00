"""Evaluation cells: each result recorded the moment it is known, so that no finished work is lost.

A cell is one (run, model, hyperparameter point, split, task) of an evaluation, e.g. (runs/N4,
"ties", {"k": 0.2, "lam": 1.1}, "val", "mnist"); its value is what the evaluation found: the
integers (correct, total), or for the run's task-vector geometry the list of pairwise cosines. A
count cell also holds its per-image record: which of the split's images (in the dataset's fixed
order) the model classified correctly, packed one bit per image (mima.evaluation.statistics'
pack_record: numpy.packbits in base64, 1,668 characters for 10,000 images), from which the counts
are derived; the intervals and paired tests of the results are computed from these records. The
results table is built from the cells, never from anything held in memory.

On disk (in the evaluation folder, `mima evaluate --out`):
    cells.json                   the manifest: what the cells are results of (the runs with their
                                 files' sizes and modification times, the merges, the selection,
                                 the precision, ...). A folder whose manifest differs belongs to
                                 another evaluation and is refused (or replaced with --overwrite).
    cells/<session>-p<rank>.jsonl one file per process and session, one JSON line per cell, appended
                                 and fsynced as each cell finishes: {"cell", "value", "images",
                                 "check"} ("images": the per-image record of a count cell; a line
                                 without it, written by an earlier mima, is still used, without
                                 the paired tests its record would give).
No file is ever written by two processes, and none is locked, so the folder may sit on a shared
filesystem (Lustre, GPFS, NFS). A line cut short by a kill is ignored when reading (its cell is
simply evaluated again).

Every cell read back is checked before it is used (`value_problem`, `CellStore.load`): its "check"
is a digest of the manifest it was recorded under, its identity, its value and its per-image record,
so an edited line, or one copied from another evaluation, does not match; counts are whole numbers
with 0 <= correct <= total, and every cell of one (split, task) counts the same images; a per-image
record holds exactly `total` images of which exactly `correct` are set; cosines are numbers in
[-1, 1]. A bad line is left out (its cell is evaluated again) and named once per file in
`CellStore.rejected`: a result is never built from it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mima.core.errors import MimaError
from mima.core.bounded_json import read_json
from mima.core.files import write_json_atomic
from mima.evaluation.statistics import pack_record, unpack_record

GEOMETRY = "pairwise_cos_tau"  # the model of the cell holding a run's task-vector cosines (split and task "-")
COSINE_SLACK = 1e-6  # a cosine computed in floating point may pass 1 by rounding


@dataclass(frozen=True, order=True)
class Cell:
    run: str  # the run folder, as its resolved path
    model: str  # zero_shot, fine_tuned, joint, pairwise_cos_tau or a merge name
    point: str  # the hyperparameters as canonical JSON ("{}" where there are none)
    split: str  # val, test, or "-" (pairwise_cos_tau)
    task: str  # a task name, or "-"

    def as_list(self) -> list[str]:
        return [self.run, self.model, self.point, self.split, self.task]


@dataclass(frozen=True, eq=False)
class ImageRecord:
    """What `CellStore.record` takes for a count cell: which images the model classified correctly
    (a boolean array in the split's order); the cell's value, the counts, is derived from it."""

    correct: np.ndarray

    def counts(self) -> list[int]:
        return [int(np.count_nonzero(self.correct)), int(self.correct.shape[0])]


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
        self.images: dict[Cell, str] = {}  # each count cell's per-image record, as recorded (pack_record)
        self.rejected: list[str] = []  # one line per cell file with lines left out by the last `load`
        self._fingerprint: str | None = None  # the manifest's digest, part of every cell's check

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
        if stored == {}:
            # damaged: not another evaluation's. Each cell's check digest holds the fingerprint of the
            # manifest it was computed under, so under this one a cell of the same evaluation is still
            # used and any other is evaluated again: nothing finished is lost, nothing foreign published
            print(f"mima: {self.manifest_file} was damaged; written again for this evaluation (finished cells that "
                  "match it are kept, the others evaluated again)", file=sys.stderr)
            stored = None
        elif stored is not None and not same_evaluation(stored, manifest):
            if not overwrite:
                raise MimaError(f"--out {self.folder}: holds the evaluation of {describe_difference(stored, manifest)}; "
                                "give another --out, or --overwrite to replace it")
            self.clear()
        elif stored is None and self.cells_dir.is_dir() and any(self.cells_dir.iterdir()):
            self.clear()  # cells without a manifest: left by an interrupted --overwrite
        self.cells_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.manifest_file, dict(manifest))
        self._fingerprint = None

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

    @property
    def fingerprint(self) -> str:
        """The digest of the manifest on disk (its session aside): what every cell's check binds it to."""
        if self._fingerprint is None:
            self._fingerprint = manifest_fingerprint(self.read_manifest() or {})
        return self._fingerprint

    # ------------------------------------------------------------------ cells
    def load(self) -> int:
        """Read every process's cells, each checked (the module text); returns how many cells are
        known. The files with lines left out are named in `rejected`, one line each."""
        found: dict[Cell, object] = {}
        images: dict[Cell, str] = {}
        where: dict[Cell, tuple[Path, int]] = {}
        bad: dict[Path, list[tuple[int, str]]] = {}
        if self.cells_dir.is_dir():
            for path in sorted(self.cells_dir.glob("*.jsonl")):
                cells, problems = read_checked_entries(path, self.fingerprint)
                for cell, (number, entry) in cells.items():
                    found[cell], where[cell] = entry["value"], (path, number)
                    images.pop(cell, None)  # a later line of the cell replaces an earlier one whole
                    if "images" in entry:
                        images[cell] = entry["images"]
                if problems:
                    bad[path] = problems
        for cell, why in other_image_counts(found).items():
            path, number = where.pop(cell)
            del found[cell]
            images.pop(cell, None)
            bad.setdefault(path, []).append((number, why))
        self.values, self.images = found, images
        self.rejected = [describe_rejected(path, sorted(problems)) for path, problems in sorted(bad.items())]
        return len(self.values)

    def __contains__(self, cell: Cell) -> bool:
        return cell in self.values

    def get(self, cell: Cell):
        """The cell's value; one line if it has none (its lines were all left out, as `rejected` says)."""
        if cell not in self.values:
            raise MimaError(f"{self.cells_dir}: no valid result for {cell.as_list()} (see the lines above); "
                            "remove the cell files named there to evaluate their cells again")
        return self.values[cell]

    def correct_images(self, cell: Cell) -> np.ndarray | None:
        """The cell's per-image record (which images were classified correctly), or None where its
        line has none (written by an earlier mima)."""
        if cell not in self.images:
            return None
        return unpack_record(self.images[cell], self.get(cell)[1])  # checked when read: cannot fail

    def record(self, cell: Cell, value: object) -> None:
        """Append the cell to this process's file and force it to disk before going on. `value`: the
        counts, the cosines, or an ImageRecord (stored as its counts and its packed record)."""
        images = None
        if isinstance(value, ImageRecord):
            value, images = value.counts(), pack_record(value.correct)
        entry = {"cell": cell.as_list(), "value": value, **({} if images is None else {"images": images}),
                 "check": cell_check(self.fingerprint, cell.as_list(), value, images)}
        line = json.dumps(entry) + "\n"
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
        self.images.pop(cell, None)
        if images is not None:
            self.images[cell] = images

    def missing(self, cells: Iterable[Cell]) -> list[Cell]:
        return [cell for cell in cells if cell not in self.values]


def read_checked_cells(path: Path, fingerprint: str) -> tuple[dict[Cell, tuple[int, object]], list[tuple[int, str]]]:
    """The good cells of one file with their line numbers and values, and (line number, why) for
    each bad line (a last line cut by a kill is neither: it was never finished)."""
    found, problems = read_checked_entries(path, fingerprint)
    return {cell: (number, entry["value"]) for cell, (number, entry) in found.items()}, problems


def read_checked_entries(path: Path, fingerprint: str) -> tuple[dict[Cell, tuple[int, dict]], list[tuple[int, str]]]:
    """As `read_checked_cells`, with each good line's whole entry (value, per-image record)."""
    found: dict[Cell, tuple[int, dict]] = {}
    problems: list[tuple[int, str]] = []
    for number, entry in _complete_lines(path):
        why = line_problem(entry, fingerprint)
        if why is None:
            found[Cell(*entry["cell"])] = (number, entry)
        else:
            problems.append((number, why))
    return found, problems


def _complete_lines(path: Path) -> Iterable[tuple[int, object]]:
    """(line number, parsed JSON or None where the line is not JSON) of each complete line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise MimaError(f"{path}: cannot read this cell file ({error}); remove it to evaluate its cells again") from None
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        if not line.endswith("\n"):
            break
        try:
            yield number, json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            yield number, None


def manifest_fingerprint(manifest: Mapping) -> str:
    return hashlib.sha256(json.dumps(_comparable(manifest), sort_keys=True).encode("utf-8")).hexdigest()[:16]


def cell_check(fingerprint: str, cell: list, value: object, images: object = None) -> str:
    """The digest that binds a cell's identity, value and per-image record (where it has one) to the
    evaluation it was recorded in."""
    content = [fingerprint, cell, value] + ([] if images is None else [images])
    return hashlib.sha256(json.dumps(content).encode("utf-8")).hexdigest()[:16]


def line_problem(entry: object, fingerprint: str) -> str | None:
    """Why one parsed cell line cannot be used (None: it can)."""
    if not isinstance(entry, dict) or not {"cell", "value"} <= set(entry):
        return "not a cell record"
    cell = entry["cell"]
    if not isinstance(cell, list) or len(cell) != 5 or not all(isinstance(part, str) for part in cell):
        return "its cell is not five names (run, model, point, split, task)"
    why = value_problem(Cell(*cell), entry["value"])  # first: an impossible value says more than its digest
    if why is None and entry.get("check") != cell_check(fingerprint, cell, entry["value"], entry.get("images")):
        why = ("no check digest (written by an earlier mima)" if "check" not in entry else
               "its check digest does not match its content (edited, or from another evaluation)")
    if why is None and "images" in entry:  # a record the digest matches but the counts do not: forged
        why = images_problem(Cell(*cell), entry["value"], entry["images"])
    return why


def images_problem(cell: Cell, value: object, images: object) -> str | None:
    """Why `images` cannot be the per-image record of `cell` with counts `value` (None: it can)."""
    if cell.model == GEOMETRY:
        return "a per-image record on the cosines cell"
    correct, total = value
    if not isinstance(images, str):
        return f"its per-image record {_short(images)} is not text"
    try:
        record = unpack_record(images, total)
    except ValueError as error:
        return f"its per-image record is not one of {total} images ({error})"
    if int(np.count_nonzero(record)) != correct:
        return f"its per-image record has {int(np.count_nonzero(record))} correct images, its count {correct}"
    return None


def value_problem(cell: Cell, value: object) -> str | None:
    """Why `value` cannot be `cell`'s result (None: it can): counts (correct, total) are whole
    numbers with 0 <= correct <= total; the cosines cell holds cosines."""
    if cell.model == GEOMETRY:
        return _cosines_problem(value)
    if not (isinstance(value, list) and len(value) == 2 and all(_is_whole(count) for count in value)):
        return f"its value {_short(value)} is not two whole numbers (correct, total)"
    correct, total = value
    if not 0 <= correct <= total:
        return f"{correct} correct of {total} images"
    return None


def _cosines_problem(value: object) -> str | None:
    if not isinstance(value, dict) or not isinstance(value.get("pairs"), list) or "mean" not in value:
        return f"its value {_short(value)} is not the task vectors' cosines (pairs, mean)"
    pairs, mean = value["pairs"], value["mean"]
    if not all(_is_cosine(pair) for pair in pairs):
        return f"its pairwise cosines {_short(pairs)} are not all numbers in [-1, 1]"
    # one task has no pairs: their mean is NaN
    if not (_is_cosine(mean) or (not pairs and isinstance(mean, float) and math.isnan(mean))):
        return f"its mean cosine {_short(mean)} is not a number in [-1, 1]"
    return None


def _is_whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_cosine(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= 1 + COSINE_SLACK


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def other_image_counts(cells: Mapping[Cell, object]) -> dict[Cell, str]:
    """The count cells whose total differs from that of most cells of their (split, task): every
    model is evaluated on the same images, so a (split, task) has one size."""
    totals: dict[tuple[str, str], Counter] = {}
    for cell, value in cells.items():
        if cell.model != GEOMETRY:
            totals.setdefault((cell.split, cell.task), Counter())[value[1]] += 1
    odd = {}
    for cell, value in cells.items():
        if cell.model != GEOMETRY:
            size, _ = totals[(cell.split, cell.task)].most_common(1)[0]
            if value[1] != size:
                odd[cell] = f"{value[1]} images of ({cell.split}, {cell.task}), where the other cells count {size}"
    return odd


def describe_rejected(path: Path, problems: list[tuple[int, str]]) -> str:
    """One line naming a cell file and its first bad line (why), and how many more there are."""
    number, why = problems[0]
    more = f" (and {len(problems) - 1} more line(s))" if len(problems) > 1 else ""
    return f"{path}: line {number} is not a valid cell: {why}{more}; left out, its cell is evaluated again"


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
