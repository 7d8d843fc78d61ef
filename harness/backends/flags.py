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

from harness.errors import HarnessError

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


@functools.cache
def server_flags(server_bin: Path) -> frozenset[str]:
    """The flags a llama-server binary accepts, parsed once from its `--help`."""
    try:
        proc = subprocess.run([str(server_bin), "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise HarnessError(f"cannot run {server_bin} --help: {err}") from None
    return frozenset(word.rstrip(",") for word in (proc.stdout + proc.stderr).split() if word.startswith("-"))


def _is_flag(word: str) -> bool:
    return word.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", word)


def fit_to_build(cmd: list[str], accepted: frozenset[str], version: str) -> list[str]:
    """`cmd` (a llama-server command line, the binary first) in the spelling of the build that accepts the flags
    `accepted` (server_flags) and calls itself `version` (server_version)."""
    out = [cmd[0]]
    for i, word in enumerate(cmd[1:], 1):
        if not _is_flag(word) or word in accepted:
            out.append(word)
        elif RENAMED.get(word) in accepted:
            out.append(RENAMED[word])
        else:
            value = cmd[i + 1] if i + 1 < len(cmd) and not _is_flag(cmd[i + 1]) else None
            setting = SETTINGS.get(word) or f"the speculative option {word[2:]}" + (f" = {value}" if value else "")
            older = f" (nor its older spelling {RENAMED[word]})" if word in RENAMED else ""
            raise HarnessError(
                f"llama-server {version} ({Path(cmd[0]).name}) has no {word}{older}, which {setting} "
                "needs: use a newer build or another setting"
            )
    return out
