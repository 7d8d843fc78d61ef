"""`junit.xml` for CI dashboards: one testcase per check verdict, named like the pytest items.

`classname` is the suite file as pytest's junitxml writes it (`suites.quicksort.yaml`), `name` the
pytest item plus the check (`quicksort[C-seq-none-tiny-dense-inproc]::baseline`), so a dashboard keeps
one history per verdict. A failed verdict is a `<failure>` whose `type` is its failure
signature (harness.signatures: one type per distinct failure; a verdict that only restates a crash, such as
a check of the crashed request, also carries a `restates` property); a known llama.cpp defect is `<skipped
type="known-failure">` with its upstream reference (pytest reports its xfails the same way); a verdict with no
baseline yet to compare with (a model new to the harness) is `<skipped type="no-baseline">`; a check a harness
fault kept from judging (its cell or reference cell could not be served) is an `<error type="harness-error">`; a
check that did not run (it does not apply, or lacked what it judges) is `<skipped type="not-run">` with the reason,
and a cell an interrupted run never reached one `<skipped type="cell-not-run">` testcase named like its pytest item
(a consumer tells work lost to the interruption from checks that do not apply); a verdict that passed by
excusing proven near-ties passes, with a property saying so, and one that passed with a seeded sampled divergence
reported only (status `reported`) passes with a `reported_only` property and `<system-out>reported only: <message>`.
"""

import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from harness.paths import write_atomic
from harness.report.files import RunDir, cell_id, item_name, status
from harness.signatures.group import by_verdict

CELL_NOT_RUN = "cell-not-run"
"""The skipped type of a cell an interrupted run never reached (a check that did not apply is `not-run`)."""


def _classname(run: RunDir, suite: str) -> str:
    path = (run.meta.get("suites") or {}).get(suite) or f"suites/{suite}.yaml"
    return path.replace("\\", "/").replace("/", ".")


def junit_xml(run: RunDir) -> bytes:
    """The document (UTF-8 bytes)."""
    cells = run.meta.get("cells") or []
    errors = {(c["suite"], c["id"]): c.get("error", "") for c in cells if c.get("status") == "error"}
    upstream = {e["id"]: e.get("upstream") for e in run.meta.get("known_failures") or []}
    by_suite: dict[str, list[ET.Element]] = defaultdict(list)
    counts: dict[str, dict[str, int]] = defaultdict(lambda: {"tests": 0, "failures": 0, "errors": 0, "skipped": 0})
    signature = by_verdict([f for f, _ in run.failures()])
    for v in run.checks:
        suite, st = v["suite"], status(v)
        case = ET.Element("testcase", classname=_classname(run, suite), name=f"{item_name(v)}::{v['check']}", time="0")
        message = v.get("message") or ""
        first = (message.strip().splitlines() or [""])[0]
        tally = counts[suite]
        tally["tests"] += 1
        if st == "harness-error":  # no verdict: a harness fault kept the check from judging (pytest: ERROR)
            ET.SubElement(case, "error", message=first, type="harness-error").text = v.get("harness_error") or message
            tally["errors"] += 1
        elif st == "not-run":
            reason = v.get("not_run") or ""
            ET.SubElement(case, "skipped", message=f"not run: {reason}", type="not-run").text = reason
            tally["skipped"] += 1
        elif (suite, cell_id(v)) in errors and st == "failed":
            ET.SubElement(case, "error", message=first, type="cell-not-served").text = message
            tally["errors"] += 1
        elif st == "failed":
            sig, restates = signature[id(v)]
            ET.SubElement(case, "failure", message=first, type=sig).text = message
            if restates:
                ET.SubElement(ET.SubElement(case, "properties"), "property", name="restates", value=sig)
            tally["failures"] += 1
        elif st == "known":
            known = v["evidence"]["known_failure"]
            ref = upstream.get(known)
            note = f"known llama.cpp defect {known}" + (f" ({ref})" if ref else "") + f": {first}"
            ET.SubElement(case, "skipped", message=note, type="known-failure").text = message
            tally["skipped"] += 1
        elif st == "no-baseline":
            ET.SubElement(case, "skipped", message=first, type="no-baseline").text = message
            tally["skipped"] += 1
        elif st == "near-tie":
            props = ET.SubElement(case, "properties")
            ET.SubElement(props, "property", name="near_ties", value=str(v["evidence"]["near_ties"]))
        elif st == "reported":  # passed, yet its output changed: a dashboard shows it
            ET.SubElement(ET.SubElement(case, "properties"), "property", name="reported_only", value=first)
            ET.SubElement(case, "system-out").text = f"reported only: {message}"
        if v["check"] == "distribution" and "p_value" in (v.get("evidence") or {}):
            evidence = v["evidence"]
            props = case.find("properties")
            props = ET.SubElement(case, "properties") if props is None else props
            for name in ("p_value", "tokens", "alpha"):
                ET.SubElement(props, "property", name=name, value=str(evidence.get(name)))
        by_suite[suite].append(case)
    for c in cells:
        if c.get("status") == "not run":
            case = ET.Element(
                "testcase", classname=_classname(run, c["suite"]), name=f"{c['suite']}[{c['id']}]", time="0"
            )
            ET.SubElement(
                case, "skipped", message="not run: the run was interrupted before this cell", type=CELL_NOT_RUN
            )
            by_suite[c["suite"]].append(case)
            counts[c["suite"]]["tests"] += 1
            counts[c["suite"]]["skipped"] += 1
    root = ET.Element("testsuites", name=f"specharness {run.run_id}")
    for suite in sorted(by_suite):
        node = ET.SubElement(
            root,
            "testsuite",
            name=suite,
            timestamp=run.meta.get("started") or "",
            **{k: str(n) for k, n in counts[suite].items()},
            time="0",
        )
        node.extend(by_suite[suite])
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)


def write_junit(run: RunDir) -> Path:
    """Write `junit.xml` into the run directory."""
    target = run.path / "junit.xml"
    data = junit_xml(run)
    write_atomic(target, lambda p: p.write_bytes(data))
    return target
