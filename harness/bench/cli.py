"""`specharness bench`: the command line of the benches (each lives in its own module)."""

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from harness import interrupt
from harness.argtypes import csv
from harness.bench import costs, speed
from harness.bench.builds import bench_build_step
from harness.bench.page import work_text, write_html, write_json
from harness.bench.reportload import bench_report
from harness.errors import HarnessError
from harness.execute.run_options import fault_name
from harness.paths import reports_dir

DISTRIBUTION_SUITE = "suites/statistical/sampling-distribution.yaml"
WHATS = ("speed", "costs", "scan", "overhead", "build-step", "report", "distribution", "seeded", "exact")


def _choose(given: list[str] | None, allowed: tuple[str, ...], default: list[str], what: str) -> list[str]:
    unknown = [v for v in given or [] if v not in allowed]
    if unknown:
        raise HarnessError(f"unknown {what} {', '.join(unknown)} (use: {', '.join(allowed)})")
    return given or default


def _fmt(x, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _table(title: str, rows: list[dict], first: str) -> Table:
    table = Table(title=title, title_justify="left")
    for name in (
        first,
        "model",
        "config",
        "tokens",
        "drafted",
        "accepted",
        "accept",
        "acc/draft",
        "tok/s",
        "spread",
        "speed-up",
        "inproc/server",
        "work",
    ):
        table.add_column(name, justify="right" if name not in (first, "model", "config", "work") else "left")
    for r in rows:
        config = f"{r['engine']} {r['spec']}" + (f" logits {r['logits']}" if r["logits"] else "")
        vary = "*" if r.get("counts_vary") else ""
        table.add_row(
            r[first],
            r["model"],
            config,
            str(r["predicted_n"]),
            f"{r['drafted']}{vary}",
            f"{r['accepted']}{vary}",
            "—" if r["acceptance"] is None else f"{100 * r['acceptance']:.1f}%",
            _fmt(r["accepted_per_draft"], 2),
            _fmt(r["tok_s"]),
            f"{_fmt(r['spread_pct'])}%",
            _fmt(r["speedup"], 2),
            _fmt(r["ratio"], 3),
            work_text(r),
        )
    return table


def harness_costs(quick: bool, console: Console) -> dict:
    """The harness-cost block of a speed bench (`--quick`: the parts that take seconds)."""
    parts = {
        "logit_logging": lambda: costs.logit_logging("gemma3-270m", n_predict=64 if quick else 128),
        "state_copies": lambda: costs.state_copies("tiny-hybrid", "draft-simple"),
        "scan_per_step": lambda: costs.scan_per_step("tiny-hybrid", repeats=2 if quick else 3),
    }
    if not quick:
        parts.update(
            {
                "overhead": lambda: costs.bench_overhead("gemma3-270m", 256),
                "scan_32k": lambda: costs.bench_scan("tiny-dense", 32768, 20),
                "suite_wall": lambda: costs.suite_wall("quicksort", "tiny-dense", "inproc"),
                "forward": lambda: costs.forward_times("gemma3-270m"),
            }
        )
    out = {}
    for name, measure in parts.items():
        console.print(f"[dim]harness cost: {name}[/dim]")
        try:
            out[name] = measure()
        except HarnessError as err:
            out[name] = {"error": str(err).splitlines()[0]}
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep the costs measured so far
            break
    return out


@dataclass
class SpeedPlan:
    """What `bench speed` measures (its options resolved, `--quick` applied) and where it writes."""

    models: list[str]
    engines: list[str]
    specs: list[str]
    logits: list[int]
    workloads: list
    repeat: int
    n_predict: int
    skip: tuple
    out: Path


def speed_plan(args: argparse.Namespace) -> SpeedPlan:
    """The bench's options resolved (an unknown name or a result file that exists is a one-line error)."""
    quick = speed.QUICK if args.quick else {}
    models = _choose(csv(args.model), speed.MODELS, quick.get("models", list(speed.MODELS)), "model")
    engines = _choose(csv(args.engine), speed.ENGINES, list(speed.ENGINES), "engine")
    specs = _choose(csv(args.spec), speed.SPECS, quick.get("specs", list(speed.SPECS)), "spec config")
    try:
        logits = [int(v) for v in csv(args.logits) or ["0"]]
    except ValueError:
        raise HarnessError(f"--logits takes top-k counts separated by commas (0 = off), not '{args.logits}'") from None
    workloads = speed.select_workloads(csv(args.workload) or quick.get("workloads"))
    out = Path(args.out) if args.out else reports_dir() / ("bench-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    if (out / "bench.json").exists():
        raise HarnessError(f"{out / 'bench.json'} already exists (choose another --out; results are never overwritten)")
    if args.json and Path(args.json).exists():
        raise HarnessError(f"{args.json} already exists (choose another --json; results are never overwritten)")
    return SpeedPlan(
        models=models,
        engines=engines,
        specs=specs,
        logits=logits,
        workloads=workloads,
        repeat=args.repeat or quick.get("repeat", 3),
        n_predict=args.n_predict or 128,
        skip=() if args.spec else tuple(quick.get("skip", ())),
        out=out,
    )


def measure_speed(plan: SpeedPlan, args: argparse.Namespace, console: Console) -> dict:
    """Run the plan (and, unless `--no-costs` or interrupted, the harness costs): the content of bench.json,
    with the machine's load before and after and how each backend's llama.cpp was built."""
    from harness.backends.choose import backend_factories
    from harness.backends.facts import backend_facts
    from harness.report.files import host, now

    machine = {**host(), "load_before": round(os.getloadavg()[0], 2)}
    started = now()
    measured = speed.run_speed(
        plan.models,
        plan.engines,
        plan.specs,
        plan.logits,
        plan.workloads,
        plan.repeat,
        plan.n_predict,
        backend_factories(args.server_bin and Path(args.server_bin), args.source and Path(args.source)),
        warn=lambda line: console.print(f"[yellow]{line}[/yellow]"),
        progress=lambda line: console.print(f"[dim]{line}[/dim]"),
        skip=plan.skip,
    )
    data = {
        "tool": "specharness bench",
        "started": started,
        "command": " ".join(args.command_line),
        "machine": machine,
        "repeat": plan.repeat,
        "n_predict": plan.n_predict,
        "environment": {name: backend_facts(name, b) for name, b in measured.pop("backends").items()},
        **measured,
    }
    data["costs"] = {} if args.no_costs or data["interrupted"] else harness_costs(args.quick, console)
    data["interrupted"] = interrupt.received() is not None
    data["machine"]["load_after"] = round(os.getloadavg()[0], 2)
    return data


def print_speed(data: dict, console: Console) -> None:
    """The tables per workload and aggregated, the in-process/server parity and the harness costs."""
    console.print(_table("per workload", data["rows"], "workload"))
    console.print(_table("aggregate", data["aggregate"], "group"))
    if any(r["counts_vary"] for r in data["rows"]):
        console.print(
            "* drafted / accepted differ between repeats (the mean is shown): ngram-mod's pool learns "
            "from every earlier request of its slot"
        )
    for p in data["parity"]:
        mark = "[green]holds[/green]" if p["holds"] else "[red]misses[/red]"
        console.print(
            f"parity {p['group']} {p['spec']} logits {'on' if p['logits'] else 'off'}: "
            f"in-process/server {p['ratio']:.3f}, {p['ratio_min']:.3f}–{p['ratio_max']:.3f} over "
            f"{p['repeats']} paired repeats (target ≥ {p['target']}) {mark}"
        )
    for name, row in data["costs"].items():
        console.print(f"[bold]{name}[/bold]: " + ", ".join(f"{k} {v}" for k, v in row.items()))


def write_speed(out: Path, data: dict, also: str | None) -> Path:
    """bench.json and its page in `out` (and the JSON at `also`, `--json`), written in full even when a signal
    comes; returns the page."""
    with interrupt.deferred():
        interrupt.phase("writing")
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "bench.json", data)
        page = write_html(out, data)
        if also:
            write_json(Path(also), data)
    return page


def cmd_speed(args: argparse.Namespace, console: Console) -> int:
    """`specharness bench speed`: resolve the options, measure, print the tables, write bench.json and its page."""
    plan = speed_plan(args)
    data = measure_speed(plan, args, console)
    print_speed(data, console)
    page = write_speed(plan.out, data, args.json)
    console.print(f"bench: {plan.out / 'bench.json'} · report: {page}")
    if data["interrupted"]:
        console.print("bench: interrupted; bench.json holds the models measured before it")
    return 0


def cmd_distribution(args: argparse.Namespace, console: Console) -> int:
    """`specharness bench distribution`: the `distribution` check's p-values over `--runs` fresh-seeded
    repetitions of a suite's cases, per cell (false alarms on a clean build; power with `--fault`)."""
    from harness.backends.choose import backend_factories
    from harness.bench import distribution
    from harness.execute import ExecOptions, Executor

    out = Path(args.out) if args.out else reports_dir() / time.strftime("bench-distribution-%Y%m%d-%H%M%S")
    for target in (out / "bench.json", Path(args.json) if args.json else None):
        if target is not None and target.exists():  # before the measuring, not after it
            raise HarnessError(f"{target} already exists (choose another path; bench results are never overwritten)")
    out.mkdir(parents=True, exist_ok=True)
    faults = args.fault or [None]
    if len(faults) > 1 and args.what == "seeded":
        raise HarnessError("bench seeded takes one --fault")
    only = {
        "backends": _opt(args.engine),
        "modes": _opt(args.mode),
        "specs": _opt(args.spec),
        "models": _opt(args.model),
    }

    def show(cell: str, row: dict) -> None:
        console.print(f"{cell}: " + ", ".join(f"{k} {v}" for k, v in row.items() if k != "first_failure"))

    def executor(fault: str | None) -> Executor:
        engine = {"fault": fault} if fault else {}
        backends = backend_factories(args.server_bin, args.source, out)
        top_k = 0 if args.what == "exact" else ExecOptions.logit_top_k  # exact scores no position's logits
        return Executor(ExecOptions(backends=backends, engine=engine, kv_scan="off", logit_top_k=top_k))

    if args.what == "exact":
        from harness.bench import exact

        suite = args.suite if args.suite != DISTRIBUTION_SUITE else exact.SUITE
        data = {"suite": suite, "draws": args.draws, "first_test": args.first_test, "sweep": []}
        for fault in faults:  # a graded fault's strengths one after another: the test's power curve
            rows = exact.measure(
                suite,
                args.draws,
                executor(fault),
                only,
                on_cell=_exact_line(console, fault),
                repeat=args.tests,
                first_test=args.first_test,
            )
            data["sweep"].append({"fault": fault, "cells": rows})
        failed = [r for e in data["sweep"] for r in e["cells"].values() if "passed" in r and not r["passed"]]
        errors = [r for e in data["sweep"] for r in e["cells"].values() if "harness_error" in r]
    elif args.what == "seeded":
        suite = args.suite if args.suite != DISTRIBUTION_SUITE else "sampling"
        rows = distribution.measure_seeded(suite, args.runs, executor(faults[0]), only, on_cell=show)
        data = {"suite": suite, "runs": args.runs, "fault": faults[0], **rows}
    else:
        sampling = _sampling(args.sampling)
        data = {"suite": args.suite, "runs": args.runs, "sampling": sampling, "sweep": []}
        for fault in faults:  # a graded fault's strengths one after another: the check's power curve
            if fault:
                console.print(f"fault {fault}:")
            rows = distribution.measure(args.suite, args.runs, executor(fault), only, on_cell=show, sampling=sampling)
            data["sweep"].append({"fault": fault, "cells": rows})
        if len(faults) == 1:
            data.update(fault=faults[0], cells=data.pop("sweep")[0]["cells"])
        else:
            console.print(distribution.power_table(data["sweep"]))
    write_json(out / "bench.json", data)
    if args.json:
        write_json(Path(args.json), data)
    console.print(f"bench: {out / 'bench.json'}")
    if args.what == "exact":  # a verdict: 1 where a cell's sample is not the exact law, 3 where one was not judged
        return 3 if errors else 1 if failed else 0
    return 0


def _exact_line(console: Console, fault: str | None):
    """The line `bench exact` prints per cell (and per test of a repeated one)."""

    def show(cell: str, row: dict) -> None:
        head = f"{fault}: " if fault else ""
        why = f"not run: {row['not_run']}" if "not_run" in row else f"harness error: {row.get('harness_error')}"
        body = row.get("message") or f"{cell}: {why}"
        console.print(f"{head}{cell}: {body}" if not body.startswith(cell) else f"{head}{body}")

    return show


def _sampling(text: str | None) -> dict | None:
    """`--sampling`'s JSON object of Sampling fields (one line on a bad one)."""
    if not text:
        return None
    from harness.suites.request import Sampling

    try:
        fields = json.loads(text)
    except json.JSONDecodeError as err:
        raise HarnessError(f"--sampling: not JSON ({err.msg}); e.g. '{{\"temperature\": 0.5}}'") from None
    unknown = (
        sorted(set(fields) - set(Sampling.__dataclass_fields__)) if isinstance(fields, dict) else ["(not an object)"]
    )
    if unknown:
        raise HarnessError(f"--sampling: unknown fields {', '.join(unknown)} (llama-server's /completion names)")
    return fields


def _opt(value: str | None) -> list[str] | None:
    return [v for v in value.split(",") if v] if value else None


def cmd_bench(args: argparse.Namespace) -> int:
    """Run one bench and print what it measured."""
    console = Console() if Console().is_terminal else Console(width=160)
    if args.what == "speed":
        return cmd_speed(args, console)
    if args.what in ("distribution", "seeded", "exact"):
        return cmd_distribution(args, console)
    if args.what == "costs":
        rows = harness_costs(args.quick, console)
    elif args.what == "scan":
        rows = {"scan": costs.bench_scan(args.model or "tiny-dense", args.cells, args.repeats)}
    elif args.what == "build-step":
        rows = {"build-step": bench_build_step(args.file, args.jobs)}
    elif args.what == "report":
        rows = {"report": bench_report(args.verdicts, args.loads)}
    else:
        rows = {"overhead": costs.bench_overhead(args.model or "gemma3-270m", args.n_predict or 256)}
    for name, row in rows.items():
        console.print(f"[bold]{name}[/bold]")
        for key, value in row.items():
            console.print(f"{key:>28}: {value}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specharness bench`."""
    p = sub.add_parser(
        "bench",
        help="measure speed on this machine: speculative speed and acceptance per workload "
        "(default), harness costs, KV scan, incremental builds, report loading",
    )
    p.add_argument(
        "what",
        nargs="?",
        default="speed",
        choices=WHATS,
        help="speed (default): engines x spec configs x models x workloads; costs: what the harness costs; "
        "scan, overhead, build-step, report: single measurements",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a small subset (under 5 minutes on 2 cores): models {', '.join(speed.QUICK['models'])}; "
        f"specs {', '.join(speed.QUICK['specs'])} (not "
        + ", ".join(f"{m} {s}" for m, s in speed.QUICK["skip"])
        + f"); {len(speed.QUICK['workloads'])} workloads",
    )
    p.add_argument(
        "--model",
        help="models, comma-separated (speed: "
        + ", ".join(speed.MODELS)
        + "; scan: tiny-dense; overhead: gemma3-270m)",
    )
    p.add_argument("--engine", help="engines, comma-separated (default: inproc,server)")
    p.add_argument("--spec", help="speculative configs, comma-separated (default: " + ",".join(speed.SPECS) + ")")
    p.add_argument(
        "--workload",
        help="workloads, comma-separated: a group ("
        + ", ".join(speed.GROUPS)
        + "), a case id (quicksort.C, w1.iterative.turn2) or a case name (default: all)",
    )
    p.add_argument(
        "--logits",
        help="logit logging settings to compare, comma-separated top-k counts (in-process "
        "top-k, llama-server n_probs; 0 = off; default 0)",
    )
    p.add_argument("--repeat", type=int, help="repeats of every workload (default 3; --quick 2)")
    p.add_argument("--n-predict", type=int, help="generated tokens per request (speed: 128; overhead: 256)")
    p.add_argument("--no-costs", action="store_true", help="speed: leave out the harness-cost block")
    p.add_argument("--out", help="directory for bench.json and bench.html (default reports/bench-<UTC time>)")
    p.add_argument("--json", help="also write the numbers to this file")
    p.add_argument("--server-bin", help="a llama-server binary to use instead of building one")
    p.add_argument("--source", help="a llama.cpp checkout to build llama-server from (default: the vendored tree)")
    p.add_argument("--cells", type=int, default=32768, help="cells in the scanned state (scan)")
    p.add_argument("--repeats", type=int, default=20, help="timed scans (scan)")
    p.add_argument(
        "--file",
        default="tools/server/server-context.cpp",
        help="source file the incremental step changes (build-step)",
    )
    p.add_argument("--jobs", type=int, help="parallel compile jobs (build-step; default all cores)")
    p.add_argument("--verdicts", type=int, default=2000, help="check verdicts in the generated report (report)")
    p.add_argument("--loads", type=int, default=5, help="browser loads timed (report)")
    p.add_argument(
        "--suite",
        default=DISTRIBUTION_SUITE,
        help="distribution, seeded, exact: the suite whose cases are repeated, a name or a path (default: "
        "distribution suites/statistical/sampling-distribution.yaml, seeded sampling, exact "
        "suites/statistical/exact/fixed-prefix.yaml)",
    )
    p.add_argument("--runs", type=int, default=200, help="distribution: fresh-seeded repetitions of the cases")
    p.add_argument(
        "--draws", type=int, default=20000, help="exact: requests per cell (independent samples of the sequence)"
    )
    p.add_argument(
        "--tests",
        type=int,
        default=1,
        help="exact: independent tests per cell (each on fresh seeds); more than one prints the share that failed "
        "(the power under --fault, the false-alarm rate without)",
    )
    p.add_argument(
        "--first-test",
        type=int,
        default=0,
        help="exact: the number of the first test (default 0); test r draws the r-th block of seeds, so processes "
        "given --first-test 0 and --first-test 50 with --tests 50 split one campaign of 100 without sharing a seed",
    )
    p.add_argument("--mode", help="distribution: modes, comma-separated (default: the suite's)")
    p.add_argument(
        "--fault",
        type=lambda text: [fault_name(f) for f in text.split(",") if f],
        metavar="FAULT[,FAULT...]",
        help="distribution: an engine fault switch, or a graded one as NAME=ε, e.g. over-accept=0.2 (in-process "
        "cells; power); several, comma-separated, are measured one after another (a power curve: "
        "over-accept=0.05,over-accept=0.1)",
    )
    p.add_argument(
        "--sampling",
        help="distribution: a JSON object of sampling fields given to every case, e.g. "
        '\'{"temperature": 0.5, "n_predict": 1536, "ignore_eos": true}\' (the selftest\'s rejection part)',
    )
    p.set_defaults(func=cmd_bench)
