"""`python -m harness.docgen`: write the documentation's generated reference pages (`--check`: only compare)."""

import sys

from harness.docgen.pages import main

sys.exit(main())
