"""The checks (`checks.md`), from the check registry's docstrings (`harness.checks.CHECKS`)."""

from harness.docgen.common import _doc, _header, _paragraphs, _table, _text


def checks_page() -> str:
    from harness.checks import CHECKS
    from harness.suites import DEFAULT_CHECKS

    out = [_header("Checks", "the check registry's docstrings (`harness.checks.CHECKS`)")]
    out.append(
        "Each check is a function of a cell's outcomes returning pass / fail plus evidence, or nothing where it "
        "does not apply. A failure says what differed, where, and the command that reproduces it. How divergences "
        "are judged: [Triage](../internals/triage.md).\n"
    )
    out.append(
        _table(
            ["check", "default", "passes when"],
            [
                [f"[`{n}`](#{n})", "yes" if n in DEFAULT_CHECKS else "", _text(_doc(f).split("\n\n")[0])]
                for n, f in CHECKS.items()
            ],
        )
    )
    for name, func in CHECKS.items():
        module = func.__module__
        out.append(f"## `{name}`\n")
        out.append(f"`{module}.{func.__name__}`\n")
        out.append(_paragraphs(_doc(func)) + "\n")
    return "\n".join(out)
