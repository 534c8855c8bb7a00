"""The one exception type for mistakes a user can fix (bad files, options, configs).

The CLI prints such errors as a single line and exits non-zero; anything else is a bug
and keeps its traceback.
"""


class MimaError(Exception):
    """A user-facing error: the message names the file, key or option and what was expected."""


class RunDiverged(MimaError):
    """A fit stopped because a loss, gradient norm or weight became NaN or inf (mima.training.divergence).
    `report` names the task, what was not finite and the process step; the message adds where a resume
    would start. A sweep or study leaves such a run out of its tables and goes on with the others."""

    def __init__(self, message: str, report: str) -> None:
        super().__init__(message)
        self.report = report
