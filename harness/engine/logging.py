"""llama.cpp's own log output: silent unless asked for (`specharness --verbose`)."""

import sys

import llama_cpp

_state: dict = {"verbose": False}


@llama_cpp.llama_log_callback
def _log_callback(level, text, user_data):
    if _state["verbose"]:
        sys.stderr.write(text.decode("utf-8", errors="replace"))


def set_llama_verbose(verbose: bool) -> None:
    """Route llama.cpp's log lines to stderr when `verbose`, drop them otherwise."""
    _state["verbose"] = verbose
    llama_cpp.llama_log_set(_log_callback, None)


set_llama_verbose(False)
