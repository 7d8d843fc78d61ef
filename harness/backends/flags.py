"""What a llama-server build is and which flags it takes: its `--version` line and its `--help` flags.

The harness speaks the flags of the llama.cpp it vendors; another build (`--server-bin`, `--source` at another
commit, an older release) may spell some differently or lack them. `fit_to_build` turns a command line into
this build's: a flag it lacks is replaced by its older spelling where llama.cpp renamed it (RENAMED), else the
command is refused with one line naming the flag, the setting that needed it and the build's version.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

from harness.errors import HarnessError, Unservable

RENAMED = {
    "--spec-draft-n-max": "--draft-max",
    "--spec-draft-n-min": "--draft-min",
    "--spec-draft-p-min": "--draft-p-min",
    "--spec-draft-type-k": "-ctkd",
    "--spec-draft-type-v": "-ctvd",
}
"""Current spelling → the spelling of builds from before llama.cpp's speculative options were renamed (the
vendored tree lists `--draft-max` / `--draft-min` among its removed arguments, "use --spec-draft-n-max", and
keeps `--draft-p-min`, `-ctkd`, `-ctvd` as aliases)."""

SETTINGS = {
    "--kv-unified": "mode seq / par (one KV stream)",
    "--no-kv-unified": "mode no-kv-unified (a KV stream per slot)",
    "-fa": "flash attention (on / off / auto)",
    "-ctk": "the K cache type",
    "-ctv": "the V cache type",
    "-md": "the draft model of draft-simple",
    "--context-shift": "the suite's serve: context_shift",
    "--no-cache-prompt": "a request without the prompt cache",
    "--ctx-checkpoints": "the suite's serve: ctx_checkpoints",
    "--checkpoint-min-step": "the suite's serve: checkpoint_min_step",
    "--cache-ram": "the suite's serve: cache_ram",
    "--slot-save-path": "the KV scan of llama-server's slots",
    "--metrics": "the /metrics endpoint",
    "--no-warmup": "a server started without warm-up",
}
"""What needs each fixed flag of the command line (speculative options say their own config option)."""


@functools.cache
def server_version(server_bin: Path) -> str:
    """The `version: ...` of a llama-server binary's `--version` (e.g. `0.5.0-dev (build 6, commit 524285a)`);
    HarnessError when it does not run or prints none."""
    try:
        proc = subprocess.run([str(server_bin), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise HarnessError(f"{server_bin} does not run: {err}") from None
    version = re.search(r"^version: (.+)$", proc.stdout + proc.stderr, re.M)
    if proc.returncode != 0 or not version:
        raise HarnessError(f"{server_bin} does not look like llama-server (`--version` printed no version)")
    return version.group(1).strip()


OPTION_LINE = re.compile(r"^((?:--?[A-Za-z0-9][^\s,]*,\s*)*--?[A-Za-z0-9][^\s,]*)(?: (.*))?$")
"""An option of `--help` (llama.cpp common/arg.cpp `common_arg::to_string`): at column 0, its spellings joined by
', ', then its value placeholders (`-fa,   --flash-attn [on|off|auto]`, `--lora-scaled FNAME SCALE`)."""
HELP_COLUMN = 40
"""Where `--help` starts an option's description; an option column longer than 37 characters ends its line."""
TWO_VALUES = re.compile(r"^(\S+) (\S+)$")


class Flags(frozenset):
    """The flags a build accepts (a frozenset of spellings) and, in `arity`, how many values each takes
    (0: a switch; 1; 2: two placeholders, e.g. `--lora-scaled FNAME SCALE`)."""

    arity: dict[str, int]

    def __new__(cls, arity: dict[str, int]):
        flags = super().__new__(cls, arity)
        flags.arity = dict(arity)
        return flags


def parse_help(text: str) -> Flags:
    """The flags listed by llama-server's `--help` and their arity, from the option column of each option line
    (column 0, up to where the description starts); description text, section headers and the usage lines
    of other programs are not options."""
    arity: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith("-") or line.startswith("--- ") or set(line.split(" ")[0]) == {"-"}:
            continue
        column = (
            line[:HELP_COLUMN] if len(line) > HELP_COLUMN and line[HELP_COLUMN - 3 : HELP_COLUMN] == "   " else line
        )
        found = OPTION_LINE.match(column.strip())
        if not found:
            continue
        hint = (found.group(2) or "").strip()
        n = 0 if not hint else 2 if TWO_VALUES.match(hint) and not hint.startswith(("{", "<", "[")) else 1
        for flag in re.split(r",\s*", found.group(1)):
            arity.setdefault(flag, n)
    return Flags(arity)


@functools.cache
def server_flags(server_bin: Path) -> Flags:
    """The flags a llama-server binary accepts and their arity, parsed once from its `--help`; a HarnessError
    naming the binary when `--help` does not run, exits non-zero or lists no option."""
    try:
        proc = subprocess.run([str(server_bin), "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise HarnessError(f"cannot run {server_bin} --help: {err}") from None
    output = proc.stdout + proc.stderr
    last = (output.strip().splitlines() or ["no output"])[-1].strip()
    if proc.returncode != 0:
        raise HarnessError(
            f"{server_bin} --help exited with code {proc.returncode} ({last}): it cannot say which flags it takes; "
            "check that it runs, or give another --server-bin"
        )
    flags = parse_help(output)
    if "-m" not in flags:
        raise HarnessError(f"{server_bin} --help lists no -m option ({last}): it does not look like llama-server")
    return flags


def _is_flag(word: str) -> bool:
    return word.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", word)


SWITCH_VALUES = {"-fa": {"on": ["-fa"], "off": []}}
"""A flag that takes a value here but is a switch in older builds: the older command line for each value (before
llama.cpp's `-fa on|off|auto`, `-fa` alone turned flash attention on and off was the default)."""


ABSENT_MEANS = {"--spec-draft-sampling": "greedy"}
"""Flags whose value a build without the flag already does (sample-and-match verification before rejection sampling
landed in b11368): given that value, the flag is left out for such a build instead of the cell being unservable."""


def fit_to_build(cmd: list[str], accepted: frozenset[str], version: str) -> list[str]:
    """`cmd` (a llama-server command line, the binary first) in the spelling of the build that accepts the flags
    `accepted` (server_flags) and calls itself `version` (server_version). Where `accepted` knows the arity of
    a flag (`Flags.arity`), the values given must match it: a flag that became a switch takes its older form
    (SWITCH_VALUES), any other mismatch is refused in one line, as a missing flag is."""
    arity = getattr(accepted, "arity", {})
    out = [cmd[0]]
    i = 1
    while i < len(cmd):
        word = cmd[i]
        values = []
        while i + 1 + len(values) < len(cmd) and not _is_flag(cmd[i + 1 + len(values)]):
            values.append(cmd[i + 1 + len(values)])
        i += 1 + len(values)
        if not _is_flag(word):  # a stray value (none is expected): kept as it is
            out += [word, *values]
            continue
        value = values[0] if values else None
        setting = SETTINGS.get(word) or f"the speculative option {word[2:]}" + (f" = {value}" if value else "")
        if word in accepted:
            spelled = word
        elif RENAMED.get(word) in accepted:
            spelled = RENAMED[word]
        elif ABSENT_MEANS.get(word) == value:  # the build predates the flag and does what its default value says
            continue
        else:
            older = f" (nor its older spelling {RENAMED[word]})" if word in RENAMED else ""
            # a speculative option the build predates: the cell is not run (its checks say why); a core setting
            # (SETTINGS) the build lacks is the harness's fault to resolve: an error
            missing = HarnessError if word in SETTINGS else Unservable
            raise missing(
                f"llama-server {version} ({Path(cmd[0]).name}) has no {word}{older}, which {setting} "
                "needs: use a newer build or another setting"
            )
        takes = arity.get(spelled)
        if takes is None or takes == len(values):
            out += [spelled, *values]
        elif takes == 0 and len(values) == 1 and value in SWITCH_VALUES.get(word, {}):
            out += SWITCH_VALUES[word][value]
        else:
            given = f"{len(values)} value{'s' if len(values) != 1 else ''}" + (
                f" ({' '.join(values)})" if values else ""
            )
            wants = "no value (a switch)" if takes == 0 else f"{takes} value{'s' if takes != 1 else ''}"
            raise HarnessError(
                f"llama-server {version} ({Path(cmd[0]).name}) takes {spelled} with {wants}, but {setting} "
                f"gives it {given}: use a newer build or another setting"
            )
    return out
