"""llama.cpp's log lines as its logger writes them (common/log.cpp), read back: the one place that knows their shape.

llama-server (and any tool that calls `common_init`) prefixes each line it logs with the time since it started
and the line's level, `M.SS.mmm.uuu L ` (`0.00.632.579 D `; L: I info, W warning, E error, D debug), coloured
with ANSI escapes when its output is a terminal (`--log-colors on` elsewhere: the reset of a W/E/D line then
opens the next line). Lines that go round the logger have no prefix: a continuation line of a multi-line message,
`GGML_ASSERT(...) failed` and a backtrace (ggml prints those to stderr itself), an uncaught exception's
`what()`. The logger writes from a thread of its own, so such a line can land right after another line's
prefix: `0.00.632.579 D /src/server-context.cpp:508: GGML_ASSERT(...) failed` — its message is still the assert.

At `-lv 5` the debug lines hold the raw bytes of the tokens drafted and sampled, which need not be UTF-8: a log
is read with `read` (undecodable bytes replaced), never with a strict decode.
"""

import re
from pathlib import Path

COLOR = re.compile(r"\x1b\[[0-9;]*m")
"""An ANSI colour escape (common/log.cpp's g_col)."""
PREFIX = re.compile(r"^\d+\.\d{2}\.\d{3}\.\d{3} (?:([IWED]) )?")
"""`M.SS.mmm.uuu L `: the time since start (minutes unpadded) and the level (absent for a line of level NONE)."""
LEVELS = {"I": "info", "W": "warning", "E": "error", "D": "debug"}


def message(line: str) -> str:
    """A log line without its colours and its `M.SS.mmm.uuu L ` prefix (a line without one is kept as it is)."""
    if "\x1b" in line:
        line = COLOR.sub("", line)
    found = PREFIX.match(line)
    return line[found.end() :] if found else line


def level(line: str) -> str | None:
    """The level of a log line ("info", "warning", "error", "debug"), None when its prefix names none."""
    found = PREFIX.match(COLOR.sub("", line))
    return LEVELS[found.group(1)] if found and found.group(1) else None


def messages(text: str) -> list[str]:
    """The messages of the lines of a log's text (`message` of each)."""
    return [message(line) for line in text.splitlines()]


def read(path: Path | str, start: int = 0) -> str:
    """A log's text from byte `start` on, undecodable bytes replaced (U+FFFD)."""
    with open(path, "rb") as f:
        if start:
            f.seek(start)
        return f.read().decode("utf-8", errors="replace")
