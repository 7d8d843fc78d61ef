"""The fault switches (`faults.md`), from `harness.engine.faults.FAULTS`."""

from harness.docgen.common import _code, _header, _table, _text


def faults_page() -> str:
    from harness.engine.faults import FAULTS

    out = [_header("Fault switches", "the fault registry (`harness.engine.faults.FAULTS`)")]
    out.append(
        "`specharness run --fault NAME` (and `selftest`, `shrink`) switches on, on purpose, one bug class seen in "
        "llama.cpp's speculative path inside the in-process engine, so the harness can prove it catches it. All are "
        "off by default. Which checks catch each: [the catch matrix](../internals/selftest.md).\n"
    )
    out.append(_table(["fault", "what it does"], [[_code(n), _text(d)] for n, d in FAULTS.items()]))
    return "\n".join(out)
