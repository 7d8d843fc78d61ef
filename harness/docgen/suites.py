"""The shipped suites and the speculative configs (`suites.md`), from `suites/*.yaml` and
`harness.matrix.SPEC_PRESETS`."""

from harness.docgen.common import ROOT, _code, _header, _paragraphs, _table, _text
from harness.suites import yamltext


def suites_page() -> str:
    from harness.matrix import SPEC_PRESETS
    from harness.suites import DEFAULT_CHECKS, DEFAULT_MATRIX

    out = [_header("Shipped suites and speculative configs", "`suites/*.yaml` and `harness.matrix.SPEC_PRESETS`")]
    out.append("## Suites\n")
    out.append(
        "Each suite's `description`, its checks and its default matrix (`--model`, `--mode`, `--spec` and "
        "`--backend` narrow it). See [Suite format](suite-format.md) for the keys.\n"
    )
    for path in sorted((ROOT / "suites").glob("*.yaml")):
        if path.name == "known-failures.yaml":
            continue
        data = yamltext.load(path.read_text()) or {}
        out.append(f"### `{data.get('suite', path.stem)}`\n")
        if data.get("description"):
            out.append(_paragraphs(str(data["description"])) + "\n")
        cases = data.get("cases", [])
        checks = data.get("checks", DEFAULT_CHECKS)
        out.append(
            f"{len(cases)} case{'s' if len(cases) != 1 else ''}: "
            + ", ".join(_code(c.get("name", "?")) for c in cases)
            + ". Checks: "
            + ", ".join(_code(c) for c in checks)
            + (" (the default)" if "checks" not in data else "")
            + ".\n"
        )
        blocks = data.get("matrix", {})
        blocks = blocks if isinstance(blocks, list) else [blocks]
        rows = []
        for block in blocks:
            rows.append([", ".join(_code(v) for v in block.get(axis, DEFAULT_MATRIX[axis])) for axis in DEFAULT_MATRIX])
        out.append(_table(list(DEFAULT_MATRIX), rows))
    out.append("## Speculative configs\n")
    out.append(
        "Presets named after llama-server's `--spec-type` values; `a+b` chains the drafters of presets named "
        "after their `--spec-type` (the first drafter with a draft wins a step). A config a backend does not have "
        "is left out of its cells.\n"
    )
    rows = []
    for name, preset in SPEC_PRESETS.items():
        flags = " ".join(f"--{k} {v}" for k, v in preset.options.items())
        backends = "in-process" if preset.scripted else "llama-server" if preset.server_only else "both"
        notes = []
        if preset.scripted:
            notes.append(f"scripted drafts: {preset.scripted}")
        if preset.rejects_all:
            notes.append("every draft rejected")
        if not preset.expect_accepts:
            notes.append("`spec-ran` expects no accepted draft")
        rows.append([_code(name), _code(flags) if flags else "", backends, _text("; ".join(notes))])
    out.append(_table(["config", "llama-server flags", "backends", "notes"], rows))
    return "\n".join(out)
