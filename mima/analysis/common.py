"""What the analysis commands share: their model and output options, and their output folders.

Only the commands (`mima/analysis/<name>/command.py`) use this module; the computations take state
dicts, pools and plain numbers, and the plots take the computations' results. The options they
share are in mima.analysis.options (read before torch is imported).
"""

from __future__ import annotations

import contextlib
import io
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from mima.core.files import refuse_overwrite, write_error, write_json_atomic
from mima.core.publish import publish_folder, remove_folders, stage_folder
from mima.core.run_folder import RunFolder, SweepFolder
from mima.core.run_outputs import refuse_output_on_runs


class _Staged:
    """The output folders of one analysis command, each written into a temporary folder first."""

    def __init__(self) -> None:
        self.folders: list[tuple[Path, Path, bool, list[Path]]] = []  # staging, target, overwrite, created parents

    def stage(self, target: Path, overwrite: bool) -> Path:
        staging, created = stage_folder(target)
        self.folders.append((staging, target, overwrite, created))
        return staging

    def shown(self, text: str) -> str:
        """`text` with every staging folder named by its target (what the user will find)."""
        for staging, target, _, _ in self.folders:
            text = text.replace(str(staging), str(target))
        return text


_SESSIONS: list[_Staged] = []


@contextlib.contextmanager
def staged_outputs(command: str = "mima analyze") -> Iterator[None]:
    """Within: `output_folder` hands out a temporary folder beside the output folder; at the end of a
    block that succeeded, its files are moved into place together, under the output folder's lock
    (mima.core.run_lock), so that a failed analysis leaves the earlier outputs as they were and a
    half-written set is never seen. What the block prints names the output folder, not the temporary one."""
    session = _Staged()
    _SESSIONS.append(session)
    try:
        with contextlib.redirect_stdout(_Shown(sys.stdout, session)):
            yield
        for staging, target, overwrite, _ in session.folders:
            publish_folder(staging, target, overwrite, lock=command)
    except BaseException as exc:
        for staging, _, _, created in session.folders:
            shutil.rmtree(staging, ignore_errors=True)
            remove_folders(created)
        if isinstance(exc, Exception):  # a refused write names the output, not the temporary folder
            for staging, target, _, _ in session.folders:
                if (named := write_error(exc, target, staging)) is not exc:
                    raise named from None
        raise
    finally:
        _SESSIONS.remove(session)
        for staging, _, _, _ in session.folders:
            shutil.rmtree(staging, ignore_errors=True)


class _Shown(io.TextIOBase):
    """Standard output as it goes, with the staging folders named by their targets."""

    def __init__(self, stream, session: _Staged) -> None:
        self.stream, self.session = stream, session

    def write(self, text: str) -> int:
        self.stream.write(self.session.shown(text))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def output_folder(out: Path | None, source: RunFolder | SweepFolder | None, name: str, files: Sequence[str],
                  overwrite: bool, create: bool = True, *, inputs: Sequence[Path | None]) -> Path:
    """Resolve --out (default: the analysis folder of `source`, a run or sweep folder, else
    analysis/<name> in the working directory), refuse an --out inside the run folder of one of
    `inputs` (what the analysis reads) other than its analysis/ (mima.core.run_outputs), and refuse to
    replace earlier outputs unless --overwrite; create the folder (with `create=False` the caller
    creates it once every check of its inputs has passed, so that a mistake found late leaves no
    empty folder behind). Inside
    `staged_outputs` (`mima analyze`), the folder returned is a temporary one that becomes the output
    folder's files at the end."""
    if out is not None:
        folder = Path(out)
    else:
        folder = (source if source is not None else RunFolder(Path())).analysis_dir(name)
    refuse_output_on_runs("--out", folder, inputs, kept=lambda run: [run.analysis_root])
    if not overwrite:
        refuse_overwrite([folder / file for file in files], what=f"--out {folder}", hint="pass --overwrite")
    if _SESSIONS:
        return _SESSIONS[-1].stage(folder, overwrite)
    if create:
        folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_json(path: Path, obj: object) -> None:
    write_json_atomic(path, obj)
