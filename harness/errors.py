"""User-facing errors: one line naming the thing that is wrong and how to fix it."""


class HarnessError(Exception):
    """An error the CLI prints as one line (no traceback) before exiting with status 2."""


class HarnessBug(Exception):
    """A Python exception inside the harness (a bug of ours): reported as a harness error with its
    traceback, never counted as a check verdict or as a catch of a fault."""
