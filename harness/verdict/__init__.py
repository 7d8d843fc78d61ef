"""The verdict policy, in one place: what a check's result is and what decides it.

Every consumer (`specharness run` and the pytest plugin through the checks, `bisect`, `shrink`, `report diff`,
`calibrate`) takes these rules from here and re-implements none of them (the import contract `verdict-policy`
in pyproject.toml keeps the package below everything that judges; `duplicates --change` finds copies):

- `check_result`: a check's result (passed, failed, not run, harness error) and its evidence;
- `triage`: the first divergence of two token streams and its class (near-tie needs both runs' own logits,
  both signs checked; kv-corrupt, drift, hard, unexplained);
- `noise`: the calibrated floors per (model, backend, device) and mode, and the one near-tie rule
  (`NoiseFloor.excuses_near_ties`: where a proven near-tie is reported rather than failed);
- `signature`: what a failure's signature is (a failing verdict → the defect it shows, or the failure it
  restates), which groups a red run, pins a bisect and tells a shrink trial the same failure from another;
- `known_failures`: the llama.cpp defects recorded in suites/known-failures.yaml and the narrow evidence that
  makes a failing verdict one of them (a strict expected failure);
- `baselines`: the outputs, work and acceptance recorded per cell beside the suites, which `baseline`, `work` and
  `acceptance` compare with (keyed by what shapes them: `--update-baselines` records, never silently);
- `outcome`: a llama.cpp build's verdict from its checks (GOOD, BAD with the pinned signature, SKIP otherwise).
"""
