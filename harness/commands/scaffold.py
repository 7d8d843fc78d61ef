"""`specharness init DIR`: a starter suite and its configuration, for suites of your own.

DIR gets the layout of this repository: `suites/` (one suite, `starter.yaml`), `fixtures/baselines/` and
`fixtures/calibration/` beside it (where its baselines and calibration go), and a `pytest.ini` that points the
pytest plugin at the suites. Files that exist are never overwritten.
"""

import argparse
from pathlib import Path

from harness.errors import HarnessError

STARTER = """\
suite: starter
description: >-
  A starter suite written by `specharness init`. Put your own prompts under `cases` and your model under
  `models` (a registry name from `specharness models list`, or the path of a .gguf; draft-simple needs a
  draft: `specharness run --draft-model PATH`). Its baselines go into fixtures/baselines beside this directory.
matrix:
  - backends: [inproc]
    modes: [seq, par]
    specs: [none, draft-simple]
    models: [tiny-dense]
sampling: {n_predict: 32, temperature: 0}
run_order: [seq, par]
checks: [no-crash, repeat-identical, lossless, mode-invariant, baseline, spec-ran, kv-healthy, logits-close, acceptance]
cases:
  - {name: greeting, prompt: "Write a short greeting for a new colleague."}
  - {name: list, prompt: "List three prime numbers and explain why each is prime."}
"""

PYTEST_INI = """\
# `pytest` here runs the suites in suites/ with the specharness plugin (installed with specharness).
# Record the baselines once with `pytest --update-baselines`, then commit fixtures/.
[pytest]
specharness_suites_dir = suites
testpaths = suites
"""


def init(target: Path) -> list[Path]:
    """Write the starter files into `target` (creating it); returns the files written (existing ones are kept)."""
    if target.exists() and not target.is_dir():
        raise HarnessError(f"cannot initialise {target}: it is a file, not a directory")
    files = {target / "suites" / "starter.yaml": STARTER, target / "pytest.ini": PYTEST_INI}
    written = []
    for sub in ("suites", "fixtures/baselines", "fixtures/calibration"):
        (target / sub).mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        if not path.exists():
            path.write_text(text)
            written.append(path)
    return written


def cmd_init(args: argparse.Namespace) -> int:
    target = Path(args.dir)
    written = init(target)
    for path in written:
        print(f"written: {path}")
    kept = {target / "suites" / "starter.yaml", target / "pytest.ini"} - set(written)
    for path in sorted(kept):
        print(f"kept (exists): {path}")
    print(
        f"next: specharness run --suites-dir {target / 'suites'} --update-baselines   (records the baselines)\n"
        f"      specharness run --suites-dir {target / 'suites'}                      (compares against them)\n"
        f"      or: cd {target} && pytest"
    )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specharness init`."""
    p = sub.add_parser("init", help="write a starter suite and pytest configuration into a directory")
    p.add_argument("dir", metavar="DIR", help="the directory (created if missing)")
    p.set_defaults(func=cmd_init)
