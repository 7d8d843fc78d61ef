"""Baselines: one small human-readable JSON file per (suite, case, model, backend, device) in
`fixtures/baselines/<suite>/`, holding the tokens, the text and the environment that produced them.

`--update-baselines` writes them (atomically; a file whose tokens and text are unchanged is left
byte-identical); without it a missing baseline fails with the command that creates it; a corrupt
file is an error naming it and is never replaced.
"""

import json
import os
import re
from pathlib import Path
from typing import Optional

from harness.checks.base import CheckContext, CheckResult
from harness.checks.compare import compare_tokens
from harness.suites import suites_dir

FIELDS = ("suite", "case", "model", "backend", "device", "text", "tokens", "environment")


def default_root() -> Path:
    """`fixtures/baselines` beside the `suites/` directory in use."""
    return suites_dir().parent / "fixtures" / "baselines"


class BaselineError(Exception):
    """A baseline file that cannot be read as one."""


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", name)


def render(data: dict) -> str:
    """The file text: one field per line, in a fixed order, so diffs stay readable."""
    lines = [f"  {json.dumps(k)}: {json.dumps(data[k], ensure_ascii=False, sort_keys=True)}" for k in FIELDS]
    return "{\n" + ",\n".join(lines) + "\n}\n"


class BaselineStore:
    """Reads, checks and (with `update`) writes the baselines under `root`."""

    def __init__(self, root: Path, update: bool = False, update_command: str = ""):
        self.root = Path(root)
        self.update = update
        self.update_command = update_command or "pytest suites/{suite}.yaml --update-baselines"
        self.written: list[Path] = []

    def path(self, suite: str, case: str, model: str, backend: str, device: str) -> Path:
        return self.root / _safe(suite) / f"{_safe(case)}--{_safe(model)}--{backend}--{device}.json"

    def load(self, path: Path) -> Optional[dict]:
        """The baseline at `path`, None when there is none; BaselineError when it is corrupt."""
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise BaselineError(f"corrupt baseline file {path}: {err}") from None
        if not isinstance(data, dict) or not isinstance(data.get("tokens"), list) or not all(
            isinstance(t, int) for t in data["tokens"]
        ):
            raise BaselineError(f"corrupt baseline file {path}: no list of integer `tokens`")
        return data

    def store(self, path: Path, data: dict) -> bool:
        """Write `data` atomically unless the file already holds the same tokens and text; True if written."""
        old = self.load(path)
        if old is not None and old["tokens"] == data["tokens"] and old.get("text") == data["text"]:
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(render(data))
        os.replace(tmp, path)
        self.written.append(path)
        return True

    def check(self, ctx: CheckContext) -> CheckResult:
        """The `baseline` check of one case of one cell (updating first when asked)."""
        cell, env = ctx.cell, ctx.executor.environment(ctx.cell)
        path = self.path(ctx.run.suite.name, ctx.case, cell.model, cell.backend, env["device"])
        try:
            if self.update:
                self._update(ctx, path, env)
            data = self.load(path)
        except BaselineError as err:
            return CheckResult("baseline", False, f"{err} (fix or delete it; it is never replaced silently)")
        if data is None:
            command = self.update_command.format(suite=ctx.run.suite.name)
            return CheckResult("baseline", False, f"no baseline {path}; create it with: {command}")
        passed, message, evidence = compare_tokens(ctx, data["tokens"], [], f"baseline {path}")
        evidence["baseline"] = str(path)
        return CheckResult("baseline", passed, message, evidence)

    def _update(self, ctx: CheckContext, path: Path, env: dict) -> None:
        """Store the canonical output (mode seq, no speculation, first round) of this case."""
        canonical = ctx.reference_outcome(ctx.cell.reference(mode="seq", spec="none"))
        if canonical is None or not canonical.result.ok:
            return
        cell = ctx.cell
        self.store(path, {
            "suite": ctx.run.suite.name, "case": ctx.case, "model": cell.model, "backend": cell.backend,
            "device": env["device"], "text": canonical.result.text, "tokens": canonical.result.tokens,
            "environment": env,
        })
