"""User-facing errors: one line naming the thing that is wrong and how to fix it."""


class HarnessError(Exception):
    """An error the CLI prints as one line (no traceback) before exiting with status 2."""
