"""The reproducer bundle of a failing case: `case.json` (the exact requests, as token ids, and how each leg is
served), `repro.sh` (llama-server and curl only), `repro.py` (the in-process engine) and `ISSUE.md`.

Modules: `legs` (a trial's cell runs → the legs of `case.json`: server command line, request batches, what
to compare), `script` (repro.sh), `issue` (ISSUE.md), `replay` (what repro.py runs), `write` (the bundle).
"""
