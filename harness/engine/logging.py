"""llama.cpp's own log output: silent unless asked for (`specharness --verbose`)."""

import sys

import llama_cpp

_state: dict = {"verbose": False, "installed": False}


@llama_cpp.llama_log_callback
def _log_callback(level, text, user_data):
    if _state["verbose"]:
        sys.stderr.write(text.decode("utf-8", errors="replace"))


def set_llama_verbose(verbose: bool) -> None:
    """Route llama.cpp's log lines to stderr when `verbose`, drop them otherwise."""
    _state["verbose"] = verbose
    _state["installed"] = True
    llama_cpp.llama_log_set(_log_callback, None)


def is_verbose() -> bool:
    """Whether llama.cpp's log is shown (`specharness --verbose`); worker processes inherit the choice."""
    return _state["verbose"]


def ensure_quiet() -> None:
    """Install the log callback (silent by default) unless it is already installed; called before
    every model load, so llama.cpp stays quiet without an explicit `set_llama_verbose`."""
    if not _state["installed"]:
        set_llama_verbose(False)
