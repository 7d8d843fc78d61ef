"""The failure ID the console, the report and pytest print for a failing case of a cell,
`<suite>[<case>-<mode>-<spec>-<model>-<backend>]` (e.g. `categories[code_python-par-draft-simple-tiny-hybrid-server]`),
parsed back into its parts for `specharness shrink` / `repro`.

Case, spec and model names contain dashes, so the ID is read from the right against the names that can occur:
the backends, the models of the registry and of the run, the modes, and the spec configs (harness.matrix)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from harness import MODES
from harness.errors import HarnessError
from harness.matrix import BACKEND_NAMES, spec_preset

ID = re.compile(r"^(?:(?P<suite>[^\[\]\s]*)\[)?(?P<inner>[^\[\]\s]+?)\]?$")


@dataclass(frozen=True)
class FailureId:
    suite: str | None
    case: str
    mode: str
    spec: str
    model: str
    backend: str

    @property
    def cell(self) -> dict[str, str]:
        return {"mode": self.mode, "spec": self.spec, "model": self.model, "backend": self.backend}


def _is_spec(name: str) -> bool:
    try:
        spec_preset(name)
    except HarnessError:
        return False
    return True


def known_models(records: list[dict] = ()) -> list[str]:
    """The model names an ID can hold: the registry's, and those a run's records name (a model file's stem)."""
    from harness.models.registry import registry_names

    return list(dict.fromkeys([*registry_names(), *(str(r.get("model")) for r in records)]))


def parse(text: str, records: list[dict] = ()) -> FailureId:
    """A printed failure ID (a pytest node ID's `path::` prefix and a trailing ` [check]` are dropped) as its
    parts; a one-line error naming what could not be read."""
    raw = text.strip()
    word = raw.rsplit("::", 1)[-1].split(" ", 1)[0]
    found = ID.match(word)
    if not found or (found.group("suite") is not None and not word.endswith("]")):
        raise HarnessError(
            f"cannot read the failure ID '{raw}': expected <suite>[<case>-<mode>-<spec>-<model>-<backend>] as the "
            "console and the report print it, e.g. categories[code_python-par-draft-simple-tiny-hybrid-server]"
        )
    inner = found.group("inner")
    backend = next((b for b in BACKEND_NAMES if inner.endswith(f"-{b}")), None)
    if backend is None:
        raise HarnessError(f"the failure ID '{raw}' ends in no backend (known: {', '.join(BACKEND_NAMES)})")
    rest = inner[: -len(backend) - 1]
    models = sorted((m for m in known_models(records) if rest.endswith(f"-{m}")), key=len, reverse=True)
    for model in models:
        head = rest[: -len(model) - 1]
        for mode in MODES:
            at = head.rfind(f"-{mode}-")
            while at > 0:
                spec = head[at + len(mode) + 2 :]
                if _is_spec(spec):
                    return FailureId(found.group("suite") or None, head[:at], mode, spec, model, backend)
                at = head.rfind(f"-{mode}-", 0, at)
    if not models:
        raise HarnessError(
            f"the failure ID '{raw}' names no known model before '-{backend}' "
            f"(known: {', '.join(known_models(records))})"
        )
    raise HarnessError(
        f"cannot read the case, mode and spec config of the failure ID '{raw}' (modes: {', '.join(MODES)}; "
        "spec configs: `specharness run --help`)"
    )
