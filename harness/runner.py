"""`specharness run`: replay a suite on a backend for every model × mode and write results.json."""

import argparse
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from harness import MODES
from harness.backends.base import Backend, ServeConfig
from harness.backends.inproc import InprocBackend
from harness.errors import HarnessError
from harness.engine.faults import FAULTS
from harness.engine.rollback import STRATEGIES
from harness.engine.speculative import SPEC_TYPES, SpecConfig
from harness.models import DEFAULT_MODELS, draft_for, resolve
from harness.paths import reports_dir
from harness.result import Result
from harness.suites import DEFAULT_SUITE, Suite, load_suite

BACKENDS = {"inproc": InprocBackend}
SPEC_PARAMS = [f for f in SpecConfig.__dataclass_fields__.values()
               if f.name.startswith("spec_") and f.name not in ("spec_type", "spec_draft_model")]
"""The `--spec-*` numeric options, named exactly like llama-server's flags."""


@dataclass
class RunPlan:
    """What one `specharness run` does."""

    suite: Suite
    models: list[str]
    modes: list[str]
    backend: Backend
    spec: str = "none"
    spec_options: dict = field(default_factory=dict)
    """Explicit `--spec-*` options under llama-server's flag names (without dashes)."""
    draft_model: str | None = None
    """Draft model name or path; default `<model>-draft` when draft-simple is asked for."""
    rollback: str = "auto"
    fault: str | None = None
    parallel: int = 4

    def serve_config(self, model_name: str, mode: str) -> ServeConfig:
        """The ServeConfig of one model × mode cell (resolving models may raise HarnessError)."""
        spec = {}
        draft = None
        if self.spec != "none":
            spec = {"spec-type": self.spec, **self.spec_options}
            if "draft-simple" in self.spec:
                name = self.draft_model or draft_for(model_name)
                if name is None:
                    raise HarnessError(f"draft-simple needs --draft-model: {model_name} has no registered draft")
                draft = resolve(name).path
        return ServeConfig(model=resolve(model_name).path, mode=mode, parallel=self.parallel, draft_model=draft,
                           spec=spec, rollback=self.rollback, fault=self.fault)


def _record(plan: RunPlan, case: str, model: str, mode: str, repeat: int, result: Result) -> dict:
    return {
        "suite": plan.suite.name,
        "case": case,
        "model": model,
        "backend": plan.backend.name,
        "mode": mode,
        "spec": plan.spec,
        "repeat": repeat,
        "tokens": result.tokens,
        "text": result.text,
        "stop_reason": result.stop_reason,
        "error": result.error,
        "slot_id": result.slot_id,
        "prompt_n": len(result.prompt_tokens),
        "timings": result.timings.to_dict(),
        "spec_stats": result.spec_stats,
    }


def run_plan(plan: RunPlan, progress: Progress | None = None) -> list[dict]:
    """Run every model × mode × case × repeat; a model that cannot be served yields error records."""
    jobs = [(c, r) for r in range(plan.suite.repeats) for c in plan.suite.cases]
    records: list[dict] = []
    task = progress.add_task("run", total=len(plan.models) * len(plan.modes) * len(jobs)) if progress else None
    for model_name in plan.models:
        for mode in plan.modes:
            if progress:
                progress.update(task, description=f"{model_name} · {mode}")
            try:
                session = plan.backend.open(plan.serve_config(model_name, mode))
            except HarnessError as err:
                results = [Result(stop_reason="error", error=str(err)) for _ in jobs]
            else:
                try:
                    results = session.run([case.request for case, _ in jobs])
                finally:
                    session.close()
            records += [_record(plan, c.name, model_name, mode, r, res) for (c, r), res in zip(jobs, results)]
            if progress:
                progress.advance(task, len(jobs))
    return records


def summary_table(records: list[dict]) -> Table:
    """Per model × mode: requests, errors, tokens, speed, and how many outputs equal the `seq` ones."""
    seq = {(r["model"], r["case"], r["repeat"]): r["tokens"] for r in records if r["mode"] == "seq"}
    table = Table(title="specharness run")
    for column in ("model", "mode", "requests", "errors", "tokens", "tok/s", "= seq"):
        table.add_column(column, justify="left" if column in ("model", "mode") else "right")
    cells: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        cells.setdefault((r["model"], r["mode"]), []).append(r)
    for (model, mode), rows in cells.items():
        ok = [r for r in rows if r["error"] is None]
        ms = sum(r["timings"]["predicted_ms"] for r in ok)
        n = sum(r["timings"]["predicted_n"] for r in ok)
        same = sum(1 for r in ok if seq.get((model, r["case"], r["repeat"])) == r["tokens"])
        errors = len(rows) - len(ok)
        table.add_row(
            model, mode, str(len(rows)), f"[red]{errors}[/]" if errors else "0", str(n),
            f"{1000.0 * n / ms:.0f}" if ms else "-", f"{same}/{len(ok)}" if seq else "-",
        )
    return table


def new_run_dir(parent: Path) -> Path:
    """A fresh run directory `<parent>/<UTC time>-<random>`."""
    run_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)
    return parent / run_id


def write_results(out: Path, records: list[dict]) -> Path:
    """Write `results.json` into `out` atomically; an existing results.json is never overwritten."""
    out.mkdir(parents=True, exist_ok=True)
    _check_out(out)
    target = out / "results.json"
    tmp = out / ".results.json.tmp"
    tmp.write_text(json.dumps(records, indent=1) + "\n")
    os.replace(tmp, target)
    return target


def _csv(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise HarnessError(f"unknown {what} '{','.join(bad) or value}' (use: {', '.join(allowed)})")
    return items


def _check_out(out: Path) -> None:
    if (out / "results.json").exists():
        raise HarnessError(f"{out / 'results.json'} already exists (choose another --out; results are never overwritten)")


def cmd_run(args: argparse.Namespace) -> int:
    """`specharness run`: returns 1 when any request ended with an error."""
    modes = _csv(args.mode, MODES, "mode")
    spec = _csv(args.spec, SPEC_TYPES, "spec type")
    if args.parallel < 1:
        raise HarnessError("--parallel must be at least 1")
    out = Path(args.out) if args.out else new_run_dir(reports_dir())
    _check_out(out)
    spec_options = {f.name.replace("_", "-"): getattr(args, f.name) for f in SPEC_PARAMS
                    if getattr(args, f.name) is not None}
    plan = RunPlan(
        suite=load_suite(args.suite),
        models=args.model or list(DEFAULT_MODELS),
        modes=modes,
        backend=BACKENDS[args.backend](),
        spec="none" if "none" in spec else ",".join(spec),
        spec_options=spec_options,
        draft_model=args.draft_model,
        rollback=args.rollback,
        fault=args.fault,
        parallel=args.parallel,
    )
    console = Console(stderr=True, soft_wrap=True)
    with Progress(console=console, transient=True) as progress:
        records = run_plan(plan, progress)
    Console().print(summary_table(records))
    for r in records:
        if r["error"]:
            console.print(f"[red]error[/] {r['model']} {r['mode']} {r['case']}: {r['error']}")
    path = write_results(out, records)
    console.print(f"results: {path}")
    return 1 if any(r["error"] for r in records) else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specharness run`."""
    p = sub.add_parser("run", help="replay a suite on a backend in seq / par / no-kv-unified modes")
    p.add_argument("--suite", default=DEFAULT_SUITE, help=f"suite name (default {DEFAULT_SUITE})")
    p.add_argument("--model", action="append", metavar="NAME|PATH",
                   help="registry name or .gguf path, repeatable (default: the tiny dense, hybrid and recurrent models)")
    p.add_argument("--mode", default=",".join(MODES), help="comma-separated: seq,par,no-kv-unified (default: all)")
    p.add_argument("--backend", default="inproc", choices=sorted(BACKENDS), help="inference backend")
    p.add_argument("--spec", default="none", metavar="TYPE[,TYPE...]",
                   help=f"speculative decoding types, as llama-server's --spec-type: {', '.join(SPEC_TYPES)} (default none)")
    p.add_argument("--draft-model", metavar="NAME|PATH", help="draft model for draft-simple (default <model>-draft)")
    p.add_argument("--rollback", default="auto", choices=STRATEGIES, help="in-process rollback strategy (default auto)")
    p.add_argument("--fault", choices=sorted(FAULTS), help="switch on one fault of the in-process speculative engine")
    for f in SPEC_PARAMS:
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=type(f.default), metavar="N",
                       help=f"as llama-server (default {f.default})")
    p.add_argument("--parallel", type=int, default=4, help="slots in par and no-kv-unified modes (default 4)")
    p.add_argument("--out", metavar="DIR", help="run directory (default reports/<run-id>)")
    p.set_defaults(func=cmd_run)
