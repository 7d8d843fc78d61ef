"""Baselines: one small human-readable JSON file per (suite, case, model, backend, device) in
`fixtures/baselines/<suite>/`, holding the tokens, the text and the environment that produced them, and
(`acceptance`) per speculative cell (`<mode>/<spec>`) and round the drafted and accepted counts, with the
per-position counts where the backend reports them.

A model is known by its registry name or, for a model file, by its content (harness.models.model_key), never
by the file's path. `--update-baselines` writes them (atomically; a file whose tokens and text are unchanged is
left byte-identical), into `--baselines-dir` when given. A model that has no baseline at all for a suite,
backend and device (a model new to the harness) is `no baseline yet`: not a failure, counted apart, with the
command that records them; a missing baseline of a model that has others fails with that command; a corrupt
file is an error naming it and is never replaced.
"""

import hashlib
import json
import re
from dataclasses import asdict
from pathlib import Path

from harness.backends.build.versions import environment_version, narrowest_covering
from harness.errors import HarnessError
from harness.models import model_key
from harness.paths import write_atomic
from harness.result.logits import PositionLogits, load_case, save_parquet, to_frame
from harness.suites import suites_dir
from harness.verdict import noise

FIELDS = (
    "suite",
    "case",
    "model",
    "backend",
    "device",
    "request",
    "text",
    "tokens",
    "environment",
    "acceptance",
    "work",
)
ACCEPTANCE_FIELDS = ("draft_n", "draft_n_accepted", "drafted_per_pos", "accepted_per_pos")
"""What a baseline keeps of a request's `spec_stats` (the per-position lists only where the backend reports them)."""
CELL_ROWS = ("acceptance", "work")
"""The fields that hold rows per cell (`<mode>/<spec>` key → one row per round): `acceptance`, and `work` (the
counters of `Result.work` the backend counted, harness.result.WORK_COUNTERS; the `work` check compares with them)."""


NOT_SHAPING = ("n_predict", "n_probs", "post_sampling_probs")
"""Request fields that do not shape the output beyond its length: `n_predict` is kept on its own (a baseline recorded
at another length is compared over the shorter of the two), the rest only logs."""
SERVE_NOT_SHAPING = ("parallel",)
"""A suite's `serve` settings that do not shape the canonical output (served in `seq`: one slot)."""


def request_shape(suite, case) -> dict:
    """What shapes a case's canonical output besides the model and the llama.cpp build, as a baseline records it
    (`request`): `n_predict`, and a digest of the rest: the prompt or chat turns, the sampling (temperature, top-k/p,
    penalties, grammar, seed, stop, ...) and the suite's `serve` settings (context and batch sizes). A baseline
    whose digest differs was recorded for another request: there is no baseline yet for this one."""
    sampling = {k: v for k, v in asdict(case.sampling).items() if k not in NOT_SHAPING}
    serve = {k: v for k, v in suite.serve.items() if k not in SERVE_NOT_SHAPING}
    body = {"prompt": case.prompt, "turns": list(case.turns), "sampling": sampling, "serve": serve}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"n_predict": case.sampling.n_predict, "digest": digest}


def shape_mismatch(recorded: dict | None, shape: dict) -> str | None:
    """Why a baseline recorded for request `recorded` holds nothing for a request of `shape` (None: it was recorded
    for this request, or for it at another `n_predict`, which `compared_length` handles)."""
    if recorded is None or recorded.get("digest") == shape["digest"]:
        return None
    return (
        f"it was recorded for other request options (prompt, sampling or serve settings: digest "
        f"{recorded.get('digest')}, this run's {shape['digest']})"
    )


def compared_length(recorded: dict | None, shape: dict, stored: int, produced: int) -> int | None:
    """Over how many tokens a baseline output of `stored` tokens is compared with an output of `produced` tokens
    (None: in full). A baseline recorded at another `n_predict` is compared over the shorter limit; one that does not
    say its request (recorded before baselines did) over its own length where it is the shorter."""
    if recorded is None:
        return stored if stored < produced else None
    limits = [n for n in (recorded.get("n_predict"), shape["n_predict"]) if isinstance(n, int) and n > 0]
    if recorded.get("n_predict") == shape["n_predict"] or not limits:
        return None
    return min(limits)


def output_digest(tokens: list[int]) -> str:
    """A short digest of a request's output tokens: which output a stored acceptance row's counts were measured
    on (harness.checks.acceptance compares with it)."""
    return hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()[:16]


def shown(path: Path) -> str:
    """A path as messages show it: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def default_root(suites: Path | None = None) -> Path:
    """`fixtures/baselines` beside a suites directory (default: the one in use), as in this repository."""
    return (suites or suites_dir()).parent / "fixtures" / "baselines"


def suite_root(suite) -> Path:
    """The default baselines root of a suite: beside the directory its file is in."""
    return default_root(Path(suite.path).parent if suite.path else None)


class BaselineError(HarnessError):
    """A baseline file that cannot be read as one."""


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", name)


def _line(value) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def render(data: dict) -> str:
    """The file text: one field per line (`acceptance`: one cell per line), in a fixed order, so diffs stay
    readable."""
    lines = []
    for k in (k for k in FIELDS if k in data):
        if k in CELL_ROWS:
            cells = [f"    {_line(cell)}: {_line(data[k][cell])}" for cell in sorted(data[k])]
            lines.append(f"  {_line(k)}: {{\n" + ",\n".join(cells) + "\n  }")
        else:
            lines.append(f"  {_line(k)}: {_line(data[k])}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


class BaselineStore:
    """Reads and (with `update`) writes the baselines under `root` (None: each suite's own,
    `suite_root`); `option` is what a command that records them must add to reach this root (`--baselines-dir
    DIR`; empty for the default one). Checks read calibration files from `calibration_dir` (None: `calibration`
    beside each suite's baselines root) before the default root (harness.verdict.noise.load)."""

    def __init__(
        self,
        root: Path | None = None,
        update: bool = False,
        option: str = "",
        calibration_dir: Path | None = None,
        version_range: str = "",
    ):
        self.root = Path(root) if root else None
        self.update = update
        self.option = option
        self.calibration_dir = calibration_dir
        self.range = version_range
        """`--baselines-range`: read and write the baselines kept for this llama.cpp version range."""
        self._kept: dict[Path, list[str]] = {}
        self.versioned_used: set[str] = set()
        """The baselines kept for a version range that this run read or wrote (run.json; `diff` shows them)."""
        self.written: list[Path] = []

    def root_of(self, suite) -> Path:
        return self.root or suite_root(suite)

    def calibration_of(self, suite) -> Path:
        """Where this suite's checks look for calibration files before the default root."""
        return self.calibration_dir or suite_root(suite).parent / "calibration"

    def _kept_in(self, folder: Path) -> list[str]:
        """The names of the version-range baselines in `folder` (read once a run: every check of every case asks)."""
        if folder not in self._kept:
            names = [p.name for p in folder.glob("*@*.json")] if folder.is_dir() else []
            self._kept[folder] = [n for n in names if not n.endswith(".logits.json")]
        return self._kept[folder]

    def path(self, suite: str, case: str, model: str, backend: str, device: str, root: Path | None = None) -> Path:
        return (
            (root or self.root) / _safe(suite) / f"{_safe(case)}--{_safe(model_key(model))}--{backend}--{device}.json"
        )

    def file_of(self, ctx, case: str | None = None) -> Path:
        """The baseline file of a check's case (or of `case`) and cell: the one kept for the backend's llama.cpp
        version when there is one (`versioned`)."""
        cell, env = ctx.cell, ctx.executor.environment(ctx.cell)
        plain = self.path(
            ctx.run.suite.name, case or ctx.case, cell.model, cell.backend, env["device"], self.root_of(ctx.run.suite)
        )
        return self.versioned(plain, environment_version(env))

    def versioned(self, plain: Path, version) -> Path:
        """The file kept for `version` beside the baseline `plain`: `<name>@<range>.json`, where `<range>` is a
        known failure's kind of version item (bA..bB, bN, a commit), for what legitimately changes between llama.cpp
        versions (acceptance, work, numerics); the narrowest range that covers the version wins, else `plain`
        (every other version). With `--baselines-range R` this run reads and writes `<name>@R.json`."""
        if self.range:
            chosen = plain.with_name(f"{plain.stem}@{self.range}.json")
        else:
            prefix = f"{plain.stem}@"
            kept = {
                name[len(prefix) : -len(".json")]: plain.parent / name
                for name in self._kept_in(plain.parent)
                if name.startswith(prefix)
            }
            chosen = narrowest_covering(kept, version) if kept else None
        if chosen is None:
            return plain
        self.versioned_used.add(shown(chosen))
        return chosen

    def not_recorded(self, ctx) -> str | None:
        """`no baseline yet ...` with the command that records them when this cell's model has no baseline at
        all for the suite, backend and device (a model new to the harness); None when it has some."""
        cell, device, root = ctx.cell, ctx.executor.environment(ctx.cell)["device"], self.root_of(ctx.run.suite)
        key = _safe(model_key(cell.model))
        if any(root.glob(f"{_safe(ctx.run.suite.name)}/*--{key}--{cell.backend}--{device}.json")):
            return None
        return (
            f"no baseline yet for {key} ({ctx.run.suite.name}, {cell.backend}, {device}) in {shown(root)}; "
            f"record them with: {ctx.repro} --update-baselines{self.option}"
        )

    def rows_mismatch(self, ctx, data: dict | None) -> str | None:
        """Why the acceptance and work rows of baseline `data` are not this case's (None: they are, or there is no
        file): they were measured on another request (another `n_predict`, other options), or the file does not
        say which request (recorded before baselines did)."""
        if data is None:
            return None
        recorded, shape = data.get("request"), request_shape(ctx.run.suite, ctx.case_def)
        if recorded is None:
            return "the baseline does not record the request its rows were measured on (recorded before baselines did)"
        if recorded.get("n_predict") != shape["n_predict"]:
            before, now = recorded.get("n_predict"), shape["n_predict"]
            return f"the baseline was recorded at n_predict {before}, this run asks {now}"
        why = shape_mismatch(recorded, shape)
        return f"the baseline {why}" if why else None

    def load(self, path: Path) -> dict | None:
        """The baseline at `path`, None when there is none; BaselineError when it is corrupt."""
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise BaselineError(f"corrupt baseline file {shown(path)}: {err}") from None
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("tokens"), list)
            or not all(isinstance(t, int) for t in data["tokens"])
        ):
            raise BaselineError(f"corrupt baseline file {shown(path)}: no list of integer `tokens`")
        acceptance = data.get("acceptance", {})
        if not isinstance(acceptance, dict) or not all(
            isinstance(rows, list)
            and all(
                isinstance(r, dict) and isinstance(r.get("round"), int) and isinstance(r.get("draft_n"), int)
                for r in rows
            )
            for rows in acceptance.values()
        ):
            raise BaselineError(
                f"corrupt baseline file {shown(path)}: `acceptance` is not "
                '{"<mode>/<spec>": [{"round": int, "draft_n": int, ...}]}'
            )
        return data

    @staticmethod
    def logits_path(path: Path) -> Path:
        """The top-k logits stored beside a baseline (Parquet, float32, a few kB)."""
        return path.with_name(path.name.removesuffix(".json") + ".logits.parquet")

    def load_logits(self, path: Path) -> list[PositionLogits]:
        """The baseline's logits, [] when none were stored (or they cannot be read: triage then says unknown)."""
        try:
            return load_case(self.logits_path(path), "baseline")
        except (OSError, ValueError):
            return []

    def store(self, path: Path, data: dict, logits: list[PositionLogits]) -> bool:
        """Write `data` (and its logits) atomically unless the file already holds the same tokens and text;
        True if written."""
        old = self.load(path)
        same_output = old is not None and old["tokens"] == data["tokens"] and old.get("text") == data["text"]
        # a file recorded before baselines said their request is this one's where it holds this output
        same_request = old is not None and old.get("request", data.get("request") if same_output else None) == data.get(
            "request"
        )
        for rows in CELL_ROWS:  # rows measured on another request are not this one's: dropped
            if same_request and rows in old:
                data = {**data, rows: old[rows]}
        if same_request and same_output and "request" in old:
            if logits and not self.logits_path(path).exists():
                self._write(self.logits_path(path), lambda t: save_parquet(t, {"baseline": to_frame(logits)}))
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        if logits:
            self._write(self.logits_path(path), lambda t: save_parquet(t, {"baseline": to_frame(logits)}))
        else:
            self.logits_path(path).unlink(missing_ok=True)
        self._write(path, lambda t: t.write_text(render(data)))
        return True

    def _write(self, target: Path, write) -> None:
        write_atomic(target, write)
        self.written.append(target)

    def recorded(self, ctx) -> tuple[dict | None, Path]:
        """The baseline of a check's case and cell (None when there is none) and its path; with `update`, this
        run's canonical output is stored first. BaselineError when the file is corrupt. The `baseline` check
        (harness.checks) compares with it: this module only stores."""
        env, path = ctx.executor.environment(ctx.cell), self.file_of(ctx)
        if self.update:
            self._update(ctx, path, env)
        return self.load(path), path

    def earlier_replies(self, ctx) -> list[list[int] | None]:
        """The baseline's replies to a chat turn's earlier turns (None where not recorded or unreadable)."""
        out = []
        for key in ctx.earlier_turns:
            try:
                data = self.load(self.file_of(ctx, key))
            except BaselineError:
                data = None
            out.append(data["tokens"] if data else None)
        return out

    def acceptance(self, ctx, key: str | None = None) -> tuple[list[dict] | None, Path]:
        """The stored acceptance rows of this speculative cell's case under `key` (harness.checks.acceptance.
        options_key: `<mode>/<spec>`, with the run options that shape drafts where they are not the defaults),
        one per round, None when the baseline holds none for it, and the baseline's path. Each row carries the
        `generated` count and the `output` digest of the request it was measured on; a row written before they
        were recorded gets the baseline's own output (its tokens: the lossless output of the cell). With
        `update`, this run's rows are stored first. BaselineError when the file is corrupt."""
        cell, path = ctx.cell, self.file_of(ctx)
        key = key or f"{cell.mode}/{cell.spec}"
        data = self.load(path)
        if self.update and data is not None and self.rows_mismatch(ctx, data):  # stamped for this request first
            self._update(ctx, path, ctx.executor.environment(ctx.cell))
            data = self.load(path)
        if self.update and data is not None and ctx.completed() and all(o.result.ok for o in ctx.outcomes):
            # a request that ended before its first draft (n_predict 1) has no counters yet: it drafted none
            rows = [
                {
                    "round": o.round,
                    "draft_n": 0,
                    "draft_n_accepted": 0,
                    **{k: o.result.spec_stats[k] for k in ACCEPTANCE_FIELDS if k in o.result.spec_stats},
                    "generated": len(o.result.tokens),
                    "output": output_digest(o.result.tokens),
                }
                for o in ctx.outcomes
            ]
            if data.get("acceptance", {}).get(key) != rows:
                data["acceptance"] = {**data.get("acceptance", {}), key: rows}
                self._write(path, lambda t: t.write_text(render(data)))
        stored = None if data is None else data.get("acceptance", {}).get(key)
        if stored is None or self.rows_mismatch(ctx, data):
            return None, path
        own = {"generated": len(data["tokens"]), "output": output_digest(data["tokens"])}
        return [{**own, **row} for row in stored], path

    def work(self, ctx, key: str) -> tuple[list[dict] | None, Path]:
        """The stored work rows of this cell's case under `key` (as `acceptance`'s), one per round with the
        `generated` count and `output` digest of the request they were measured on, None when the baseline holds
        none for it (a file recorded before work was), and the baseline's path. With `update`, this run's rows
        are stored first (where every request of the case completed; a suite without the `baseline` check gets
        its baseline file, the canonical output, here)."""
        path = self.file_of(ctx)
        data = self.load(path)
        complete = ctx.completed() and all(o.result.ok for o in ctx.outcomes)
        if self.update and complete and (data is None or self.rows_mismatch(ctx, data)):  # stamped for this request
            self._update(ctx, path, ctx.executor.environment(ctx.cell))
            data = self.load(path)
        if self.update and data is not None and complete:
            rows = [
                {
                    "round": o.round,
                    **{k: v for k, v in o.result.work.counters().items() if v is not None},
                    "draft_n": o.result.spec_stats.get("draft_n", 0),
                    "generated": len(o.result.tokens),
                    "output": output_digest(o.result.tokens),
                }
                for o in ctx.outcomes
                if o.result.work.counted()
            ]
            if rows and data.get("work", {}).get(key) != rows:
                data["work"] = {**data.get("work", {}), key: rows}
                self._write(path, lambda t: t.write_text(render(data)))
        stored = None if data is None or self.rows_mismatch(ctx, data) else data.get("work", {}).get(key)
        if not isinstance(stored, list) or not all(
            isinstance(r, dict) and isinstance(r.get("round"), int) for r in stored
        ):
            if stored is not None:
                raise BaselineError(
                    f'corrupt baseline file {shown(path)}: `work` is not {{"<mode>/<spec>": [{{"round": int, ...}}]}}'
                )
            return None, path
        return stored, path

    def _update(self, ctx, path: Path, env: dict) -> None:
        """Store the canonical output (mode seq, no speculation, first round) of this case."""
        canonical = ctx.reference_outcome(ctx.cell.reference(mode="seq", spec="none"))
        if canonical is None or not canonical.result.ok:
            return
        cell = ctx.cell
        self.store(
            path,
            {
                "suite": ctx.run.suite.name,
                "case": ctx.case,
                "model": model_key(cell.model),
                "backend": cell.backend,
                "device": env["device"],
                "request": request_shape(ctx.run.suite, ctx.case_def),
                "text": canonical.result.text,
                "tokens": canonical.result.tokens,
                "environment": env,
            },
            canonical.result.logits,
        )


def not_recorded_lines(verdicts: list) -> list[str]:
    """One line per suite, model and backend whose `baseline` verdicts said `no baseline yet`, with the command
    that records them; `verdicts` are (suite, case, cell, CheckResult) tuples."""
    pending: dict[tuple, list] = {}
    for suite, _, cell, r in verdicts:
        if r.name == "baseline" and r.evidence.get("no_baseline"):
            pending.setdefault((suite, cell.model, cell.backend), []).append(r)
    return [f"{rs[0].message} ({len(rs)} verdicts)" for rs in pending.values()]


def uncalibrated_lines(executor, store: BaselineStore) -> list[str]:
    """One line per model and backend of the executor's runs that has no calibration file: the default
    tolerances its verdicts used and the command that measures them."""
    lines = {}
    for run in executor.runs():
        cell = run.cell
        if run.error is None and (cell.model, cell.backend) not in lines:
            env = executor.environment(cell)
            device = env["device"]
            floor = noise.load(cell.model, cell.backend, env, store.calibration_of(run.suite))
            lines[(cell.model, cell.backend)] = (
                None if floor.calibrated else f"{cell.model} on {cell.backend} ({device}): {floor.source}"
            )
    return [line for line in lines.values() if line]
