"""The fault switches (`faults.md`), from `harness.engine.faults.FAULTS`."""

from harness.docgen.common import _code, _header, _table, _text


def faults_page() -> str:
    from harness.engine.faults import FAULTS, GRADED

    out = [_header("Fault switches", "the fault registry (`harness.engine.faults.FAULTS`)")]
    out.append(
        "`specharness run --fault NAME` (and `selftest`, `shrink`) switches on, on purpose, one bug class seen in "
        "llama.cpp's speculative path inside the in-process engine, so the harness can prove it catches it. All are "
        "off by default. Which checks catch each: [the catch matrix](../internals/selftest.md).\n"
    )
    out.append(_table(["fault", "what it does"], [[_code(n), _text(d)] for n, d in FAULTS.items()]))
    out.append(
        "\n## Graded faults\n\n`--fault NAME=ε` switches on a bias of strength ε, to measure a statistical check's "
        "power against it (`specharness bench distribution --fault NAME=ε[,NAME=ε...]` prints the power and the "
        "fault's mean total variation per token at each strength). Not in the selftest's catch matrix.\n"
    )
    out.append(_table(["fault", "what it does"], [[_code(f"{n}=ε"), _text(d)] for n, d in GRADED.items()]))
    return "\n".join(out)
