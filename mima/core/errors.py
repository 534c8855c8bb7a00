"""The one exception type for mistakes a user can fix (bad files, options, configs).

The CLI prints such errors as a single line and exits non-zero; anything else is a bug
and keeps its traceback.
"""


class MimaError(Exception):
    """A user-facing error: the message names the file, key or option and what was expected."""
