"""The documentation site's reference pages, generated from the code so they cannot drift from it; no command of
`specharness` imports this package (the `docs-and-cli-on-top` contract).

`python -m harness.docgen` writes `docs/reference/*.md` from what the harness itself reads, one module a page: `cli`
(the argparse parsers), `suite_format` (the suite loader's JSON schema), `suites` (`suites/*.yaml` and the
speculative configs), `checks` (the check registry's docstrings), `faults` (the fault registry), `known_failures`
(`suites/known-failures.yaml`), `models` (the model registry) and `calibration` (`fixtures/calibration/*.json`);
`blocks` fills the generated blocks of the README and the site's index; `common` is what the pages share.
`python -m harness.docgen --check` only compares and exits 1 naming the pages that differ (tests/test_docs.py does
the same). The output is deterministic: sorted where the source has no order, no timestamps, no paths of the
machine that generated it.
"""

from harness.docgen.blocks import BLOCKS, default_job_block, stale_blocks, write_blocks
from harness.docgen.common import COMMAND, OUT, ROOT
from harness.docgen.pages import PAGES, main, render, stale

__all__ = [
    "BLOCKS",
    "COMMAND",
    "OUT",
    "PAGES",
    "ROOT",
    "default_job_block",
    "main",
    "render",
    "stale",
    "stale_blocks",
    "write_blocks",
]
