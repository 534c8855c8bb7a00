"""Where no output goes: onto a run folder's own files, or into a run folder that a command reads.

A `mima fit` run folder (mima.core.run_folder) is written by its fit alone: its config.yaml, theta_0,
task models, checkpoints, logs and lock are what merge, evaluate, analyze and report read, and one
file written over them (a merge over config.yaml, with --overwrite) breaks the run for every later
command. So every command that writes an output (merge, evaluate, convert, report, analyze, fit,
the demo, data splits and prepare), and the Python API through the same programs, asks
`refuse_output_on_runs` before any work:

  * an output on a run folder's own paths (RunFolder.own_paths), of any run folder, is refused;
  * an output equal to or inside the run folder of an input (a run folder given, or the one a given
    file lies in, as RUN/final/a.safetensors) is refused, except in the place the run keeps for
    what that command makes from it (its caller says which: `mima evaluate --out RUN/evaluation`,
    `mima analyze`'s RUN/analysis/, `mima report`'s pages).

Paths are compared as the system resolves them (symlinks, `..`), and an existing output that is
a hard link of a run's own file counts as that file. No command replaces a whole output folder
(mima.core.publish places files into it and keeps the others), so a run folder inside an output
folder is never lost and needs no rule of its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from mima.core.errors import MimaError
from mima.core.run_folder import RunFolder, enclosing_run

PathLike = str | os.PathLike
KeptPlaces = Callable[[RunFolder], Iterable[Path]]  # the places of a run this command may write into
FIT_ONLY = "a run folder is written by its `mima fit` alone"


def refuse_output_on_runs(option: str, output: PathLike, inputs: Iterable[PathLike | None] = (),
                          kept: KeptPlaces | None = None, written: Iterable[PathLike] | None = None) -> None:
    """Refuse, in one line naming the output (`option OUTPUT`) and the run folder, an output that
    would land on a run folder's own files or inside the run folder of one of `inputs` (outside the
    places `kept` gives for that run). `written`: the paths the output puts there (default: the
    output itself). Changes nothing, so it can run before every other check."""
    runs = input_runs(path for path in inputs if path is not None)
    targets = [Path(output)] if written is None else [Path(path) for path in written]
    for target in targets:
        place = real_path(target)
        refuse_own_path(option, output, place)
        for shown, run in runs:
            refuse_inside(option, output, place, shown, run, kept)
    refuse_hard_link(option, output, [run for _, run in runs])


def real_path(path: Path) -> Path:
    """`path` as the system resolves it (every symlink and `..` of the part that exists)."""
    return Path(os.path.realpath(path))


def within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def input_runs(inputs: Iterable[PathLike]) -> list[tuple[Path, RunFolder]]:
    """The run folders of `inputs` (each resolved; the run as the user named it, where an input is
    one), each once."""
    found: dict[Path, tuple[Path, RunFolder]] = {}
    for given in inputs:
        run = enclosing_run(real_path(Path(given)))
        if run is not None and run.path not in found:
            shown = Path(given) if run.path == real_path(Path(given)) else run.path
            found[run.path] = (shown, run)
    return list(found.values())


def refuse_own_path(option: str, output: PathLike, place: Path) -> None:
    """An output on a file or folder of the run folder it lies in, whichever run that is."""
    run = enclosing_run(place)
    if run is None:
        return
    for own in run.own_paths():
        if within(place, own):
            raise MimaError(f"{option} {output}: would write over {named(own, run)} of the run folder {run.path} "
                            f"({FIT_ONLY}); choose an output outside it")


def refuse_inside(option: str, output: PathLike, place: Path, shown: Path, run: RunFolder,
                  kept: KeptPlaces | None) -> None:
    """An output inside an input's run folder, outside the places kept for this command's outputs."""
    if not within(place, run.path):
        return
    places = list(kept(run)) if kept is not None else []
    if any(within(place, kept_place) for kept_place in places):
        return
    alternative = "".join(f", or {shown / kept_place.relative_to(run.path)}" for kept_place in places)
    raise MimaError(f"{option} {output}: would write into the run folder {shown}, an input of this command "
                    f"({FIT_ONLY}); choose an output outside it{alternative}")


def refuse_hard_link(option: str, output: PathLike, runs: Iterable[RunFolder]) -> None:
    """An existing output that is a hard link of a run's own file: that file under another name."""
    path = Path(output)
    if not path.is_file() or path.stat().st_nlink < 2:
        return
    identity = (path.stat().st_dev, path.stat().st_ino)
    enclosing = enclosing_run(real_path(path))
    for run in [*runs, *([enclosing] if enclosing is not None else [])]:
        for own in own_files(run):
            if (own.stat().st_dev, own.stat().st_ino) == identity:
                raise MimaError(f"{option} {output}: is {own} under another name (a hard link), a file of the run "
                                f"folder {run.path} ({FIT_ONLY}); choose another output")


def own_files(run: RunFolder) -> Iterator[Path]:
    """Every file among the run's own paths (those under its folders too)."""
    for own in run.own_paths():
        if own.is_file() and not own.is_symlink():
            yield own
        elif own.is_dir() and not own.is_symlink():
            for root, _, files in os.walk(own):
                yield from (Path(root) / name for name in files if not (Path(root) / name).is_symlink())


def named(own: Path, run: RunFolder) -> str:
    """How the message names one of a run's own paths: config.yaml, final/, ..."""
    name = str(own.relative_to(run.path))
    folders = (run.final_dir, run.logs_dir, run.checkpoints_dir, run.mlflow_store)  # named so before they exist too
    return name + "/" if own.is_dir() or own in folders else name
