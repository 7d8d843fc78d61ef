"""Speculative speed and acceptance per prompt category, engines side by side (`specharness bench`).

Every selected model is served by every selected engine (`inproc`, `server`) under every speculative
config and logit-logging setting at once, one session each, in `seq` mode with greedy sampling. Each
repeat sends every workload (a case of `categories`, `quicksort` or a turn of `w1`) to every session in
turn (A B C … A B C …), so slow drift of a busy machine hits all configurations alike. Tokens/s is each
engine's own generation timing (llama-server's `timings.predicted_per_second`; the engine measures the
same span), the median over repeats with its spread (min–max); in-process / server is paired, the median
over repeats of the two engines' ratio within a repeat. Drafted and accepted counts are the
engines' own counters; `acc/draft` (mean accepted tokens per verified draft) needs the number of drafts,
which llama-server does not report. Work is each request's counted work (`Result.work`: target and draft
decodes, prompt tokens read and reused, checkpoints and their bytes, partial rollbacks; llama-server counts no
decodes), summed like the counts (`work`, the mean per repeat) and per generated token (`work_per_token`).
"""

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from harness import interrupt
from harness.backends.base import Backend, Session
from harness.errors import HarnessError
from harness.execute import ExecOptions, serve_config
from harness.matrix import Cell
from harness.models import ModelUnavailable, draft_for, resolve
from harness.result import WORK_COUNTERS, Result
from harness.suites import case_keys, load_suite
from harness.suites.request import Request, Sampling

GROUPS = ("categories", "quicksort", "w1")
"""The suites whose cases are the workloads (each chat turn of `w1` is one workload)."""
ENGINES = ("inproc", "server")
SPECS = ("none", "ngram-simple", "ngram-map-k", "ngram-mod", "draft-simple")
MODELS = ("tiny-dense", "tiny-hybrid", "tiny-recurrent", "gemma3-270m")
QUICK = {
    "models": ["tiny-hybrid", "gemma3-270m"],
    "specs": ["none", "ngram-mod", "draft-simple"],
    "skip": [("gemma3-270m", "draft-simple")],
    "workloads": ["quicksort.C", "w1.iterative.turn1", "categories.summarize"],
    "repeat": 2,
}
"""`--quick`: a subset that finishes in under 5 minutes on 2 cores. `skip`: (model, spec) pairs left out
unless --spec names the specs: Gemma's Q2_K self-draft runs at 9–13 tok/s and took 130 s of a 4 min
48 s quick run (tiny-hybrid's draft-simple rows still exercise a draft model)."""
PARITY = {"model": "gemma3-270m", "groups": ("quicksort", "w1"), "specs": ("none", "ngram-mod"), "off": 1.0, "on": 0.98}
"""The parity targets of issue #13: in-process / llama-server tokens/s on Gemma's quicksort and W1 turns,
without speculation and with ngram-mod: ≥ 1.0 with logit logging off, ≥ 0.98 with it on."""
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Workload:
    """One prompt: a completion, or the user turns of a chat up to this one (earlier replies are the
    model's own, generated once per model so every configuration sends the same messages)."""

    group: str
    name: str
    prompt: str | None = None
    turns: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.group}.{self.name}"


@dataclass(frozen=True)
class Config:
    """One served configuration of a model."""

    engine: str
    spec: str
    logits: int
    """Logit logging: top-k logged per token (in-process) / llama-server's `n_probs`; 0 = off."""

    @property
    def label(self) -> str:
        return f"{self.engine} {self.spec}" + (f" logits {self.logits}" if self.logits else "")


@dataclass
class Sample:
    """What one request measured, in which repeat."""

    repeat: int
    predicted_n: int
    predicted_ms: float
    wall_ms: float
    drafted: int
    accepted: int
    drafts: int | None
    work: dict | None = None
    """The request's counted work (`Work.to_dict()`: None per counter the engine did not count)."""


@dataclass
class Measured:
    """Every sample of one (model, workload, config), and the errors of the requests that failed."""

    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def all_workloads() -> list[Workload]:
    """Every case of `categories` and `quicksort`, and every turn of `w1`, in that order."""
    out: list[Workload] = []
    for group in GROUPS:
        for case in load_suite(group).cases:
            if case.is_chat:
                for i, key in enumerate(case_keys(case)):
                    out.append(Workload(group, key, turns=tuple(case.turns[: i + 1])))
            else:
                out.append(Workload(group, case.name, prompt=case.prompt))
    return out


def select_workloads(names: list[str] | None) -> list[Workload]:
    """Workloads by group (`w1`), id (`quicksort.C`) or case name (`summarize`); all when `names` is None."""
    every = all_workloads()
    if not names:
        return every
    chosen = [w for w in every if any(n in (w.group, w.id, w.name) or w.id.startswith(n + ".") for n in names)]
    unknown = [n for n in names if not any(n in (w.group, w.id, w.name) or w.id.startswith(n + ".") for w in every)]
    if unknown:
        raise HarnessError(
            f"unknown workload {', '.join(unknown)} (use a group {', '.join(GROUPS)}, "
            f"or one of: {', '.join(w.id for w in every)})"
        )
    return chosen


def _sample(repeat: int, result: Result, wall_ms: float) -> Sample:
    stats = result.spec_stats or {}
    return Sample(
        repeat,
        result.timings.predicted_n,
        result.timings.predicted_ms,
        wall_ms,
        stats.get("draft_n", 0),
        stats.get("draft_n_accepted", 0),
        stats.get("spec_cycles"),
        result.work.to_dict(),
    )


class ModelBench:
    """The sessions of one model (one per config), its chat histories, and what they measured."""

    def __init__(
        self,
        model: str,
        configs: list[Config],
        backends: dict[str, Backend],
        n_predict: int,
        warn: Callable[[str], None],
    ):
        self.model, self.n_predict, self.warn = model, n_predict, warn
        self.sessions: dict[Config, Session] = {}
        self.failed: dict[Config, str] = {}
        self.replies: list[str] = []
        for config in configs:
            options = ExecOptions(backends={}, logit_top_k=config.logits, kv_scan="off")
            try:
                served = serve_config(Cell(config.engine, "seq", config.spec, model), options)
                self.sessions[config] = backends[config.engine].open(served)
            except HarnessError as err:
                self.failed[config] = str(err).splitlines()[0]
                warn(f"{model} {config.label}: {self.failed[config]}")
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop the sessions opened so far
                self.close()
                raise

    def request(self, workload: Workload, n_predict: int | None = None) -> Request:
        sampling = Sampling(n_predict=n_predict or self.n_predict, temperature=0.0)
        if workload.prompt is not None:
            return Request(prompt=workload.prompt, sampling=sampling, tag=workload.id)
        messages: list[dict] = []
        for i, turn in enumerate(workload.turns):
            messages.append({"role": "user", "content": turn})
            if i < len(workload.turns) - 1:
                messages.append({"role": "assistant", "content": self.replies[i]})
        return Request(messages=messages, sampling=sampling, tag=workload.id)

    def prepare(self, workloads: list[Workload]) -> None:
        """Warm every session up and generate the chat replies the later turns carry."""
        interrupt.phase("serving")
        first = next(iter(self.sessions.values()), None)
        longest = max((w for w in workloads if w.turns), key=lambda w: len(w.turns), default=None)
        if first is not None and longest is not None:
            for i in range(len(longest.turns) - 1):
                result = first.run([self.request(Workload(longest.group, "history", turns=longest.turns[: i + 1]))])[0]
                if not result.ok:
                    raise HarnessError(f"{self.model}: could not generate the chat history: {result.error}")
                self.replies.append(result.text)
        for _config, session in self.sessions.items():
            session.run([self.request(workloads[0], WARMUP_TOKENS)])

    def measure(self, workloads: list[Workload], repeat: int) -> dict[tuple[str, Config], Measured]:
        """`repeat` rounds; in each, every workload goes to every session in turn."""
        out: dict[tuple[str, Config], Measured] = {}
        for r, workload in itertools.product(range(repeat), workloads):
            for config, session in self.sessions.items():
                t0 = time.perf_counter()
                result = session.run([self.request(workload)])[0]
                wall_ms = 1000 * (time.perf_counter() - t0)
                m = out.setdefault((workload.id, config), Measured())
                if result.ok:
                    m.samples.append(_sample(r, result, wall_ms))
                else:
                    m.errors.append(result.error or result.stop_reason)
                    self.warn(f"{self.model} {config.label} {workload.id}: {m.errors[-1]}")
        return out

    def close(self) -> None:
        for session in self.sessions.values():
            session.close()


def _tok_s(samples: list[Sample]) -> float:
    ms = sum(s.predicted_ms for s in samples)
    return 1000.0 * sum(s.predicted_n for s in samples) / ms if ms > 0 else 0.0


def work_of(done: list[list[Sample]], predicted_n: int) -> tuple[dict, dict]:
    """Each work counter summed per repeat, then the mean over repeats (None where a request did not count it,
    or none ran), and that per generated token (over the repeats' mean `predicted_n`)."""
    mean: dict = {}
    for name in WORK_COUNTERS:
        sums = [[(s.work or {}).get(name) for s in samples] for samples in done]
        known = done and all(v is not None for values in sums for v in values)
        mean[name] = round(statistics.mean(sum(values) for values in sums), 1) if known else None
    per = {name: v / predicted_n if v is not None and predicted_n else None for name, v in mean.items()}
    return mean, per


def summarize(key: dict, per_repeat: list[list[Sample]]) -> dict:
    """A row: counts per repeat (their mean; `counts_vary` when repeats differ, as with `ngram-mod`, whose
    hash pool learns from every earlier request of its slot), tokens/s median and spread over repeats, and the
    counted work (`work`: per repeat, its mean; `work_per_token`: per generated token)."""
    done = [samples for samples in per_repeat if samples]
    speeds = [_tok_s(samples) for samples in done]
    by_repeat = [[samples[0].repeat, speed] for samples, speed in zip(done, speeds, strict=False)]
    counts = [(sum(s.predicted_n for s in x), sum(s.drafted for s in x), sum(s.accepted for s in x)) for x in done]
    n, drafted, accepted = (round(statistics.mean(c[i] for c in counts)) if counts else 0 for i in range(3))
    drafts = [sum(s.drafts for s in x) for x in done if all(s.drafts is not None for s in x)]
    per_draft = sum(c[2] for c in counts) / sum(drafts) if drafts and len(drafts) == len(done) and sum(drafts) else None
    median = statistics.median(speeds) if speeds else None
    work, work_per_token = work_of(done, n)
    return {
        **key,
        "predicted_n": n,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "accepted_per_draft": per_draft,
        "counts_vary": len(set(counts)) > 1,
        "tok_s": median,
        "tok_s_min": min(speeds) if speeds else None,
        "tok_s_max": max(speeds) if speeds else None,
        "tok_s_by_repeat": by_repeat,
        "spread_pct": 100 * (max(speeds) - min(speeds)) / median if median else None,
        "wall_ms": statistics.mean(sum(s.wall_ms for s in x) for x in done) if done else None,
        "repeats": len(speeds),
        "work": work,
        "work_per_token": work_per_token,
    }


def _relate(rows: list[dict], keys: tuple[str, ...]) -> None:
    """Add `speedup` (over the same engine without speculation) and `ratio` (in-process / llama-server).

    The ratio is paired: in each repeat the two engines ran the same workloads back to back, so the
    ratio of that repeat's speeds cancels the machine's drift between repeats (on this VM a request's
    speed swings ±10 % within a minute); `ratio` is the median over repeats, `ratio_min`/`ratio_max`
    its spread."""
    index = {tuple(r[k] for k in keys): r for r in rows}
    for r in rows:
        base = index.get(tuple("none" if k == "spec" else r[k] for k in keys))
        server = index.get(tuple("server" if k == "engine" else r[k] for k in keys))
        r["speedup"] = r["tok_s"] / base["tok_s"] if base and r["tok_s"] and base["tok_s"] else None
        paired = _paired(r, server) if r["engine"] == "inproc" and server else []
        r["ratio"] = statistics.median(paired) if paired else None
        r["ratio_min"], r["ratio_max"] = (min(paired), max(paired)) if paired else (None, None)


def _paired(row: dict, other: dict) -> list[float]:
    """`row`'s tokens/s over `other`'s, repeat by repeat (repeats where both have a speed)."""
    theirs = dict(other["tok_s_by_repeat"])
    return [speed / theirs[repeat] for repeat, speed in row["tok_s_by_repeat"] if theirs.get(repeat)]


ROW_KEYS = ("model", "workload", "engine", "spec", "logits")
AGG_KEYS = ("group", "model", "engine", "spec", "logits")


def tables(
    measured: dict[tuple[str, str, Config], Measured], workloads: list[Workload], repeat: int
) -> tuple[list, list]:
    """The per-workload rows and the aggregate (per group and `all`) rows."""
    groups = {w.id: w.group for w in workloads}
    rows, agg_samples = [], {}
    for (model, workload, config), m in measured.items():
        per_repeat = [[s] for s in m.samples]
        key = {
            "model": model,
            "workload": workload,
            "group": groups[workload],
            "engine": config.engine,
            "spec": config.spec,
            "logits": config.logits,
        }
        row = summarize(key, per_repeat)
        row["errors"] = m.errors
        rows.append(row)
        for group in (groups[workload], "all"):
            slots = agg_samples.setdefault((group, model, config), [[] for _ in range(repeat)])
            for s in m.samples:
                slots[s.repeat].append(s)
    _relate(rows, ROW_KEYS)
    aggregate = [
        summarize({"group": g, "model": model, "engine": c.engine, "spec": c.spec, "logits": c.logits}, per_repeat)
        for (g, model, c), per_repeat in agg_samples.items()
    ]
    _relate(aggregate, AGG_KEYS)
    order = {name: i for i, name in enumerate([*GROUPS, "all", *(w.id for w in workloads), *MODELS, *SPECS, *ENGINES])}

    def by(first):
        return lambda r: (
            order.get(r[first], 99),
            order.get(r["model"], 99),
            order.get(r["spec"], 99),  # noqa: E731
            r["logits"],
            order.get(r["engine"], 99),
        )

    return sorted(rows, key=by("workload")), sorted(aggregate, key=by("group"))


def parity(aggregate: list[dict], workloads: list[Workload]) -> list[dict]:
    """The issue #13 parity targets that this run measured, with whether each holds. A target is over a
    whole group (every `quicksort` prompt, every `w1` turn): groups the run covers only in part (`--quick`)
    get no verdict."""
    ran = {w.id for w in workloads}
    whole = {g for g in PARITY["groups"] if all(w.id in ran for w in all_workloads() if w.group == g)}
    out = []
    for r in aggregate:
        if (
            r["engine"] == "inproc"
            and r["model"] == PARITY["model"]
            and r["group"] in whole
            and r["spec"] in PARITY["specs"]
            and r["ratio"] is not None
        ):
            target = PARITY["on"] if r["logits"] else PARITY["off"]
            out.append(
                {
                    "group": r["group"],
                    "spec": r["spec"],
                    "logits": r["logits"],
                    "ratio": r["ratio"],
                    "ratio_min": r["ratio_min"],
                    "ratio_max": r["ratio_max"],
                    "repeats": r["repeats"],
                    "target": target,
                    "holds": r["ratio"] >= target,
                }
            )
    return out


def configs_of(engines: list[str], specs: list[str], logits: list[int]) -> list[Config]:
    return [Config(e, s, k) for s in specs for k in logits for e in engines]


def run_speed(
    models: list[str],
    engines: list[str],
    specs: list[str],
    logits: list[int],
    workloads: list[Workload],
    repeat: int,
    n_predict: int,
    factories: dict[str, Callable[[], Backend]],
    warn: Callable[[str], None],
    progress: Callable[[str], None],
    skip: tuple = (),
) -> dict:
    """Measure every (model, workload, config) but the (model, spec) pairs in `skip`; returns the rows,
    aggregate and parity (see `tables`), the models skipped (not installed) and the backends used."""
    if repeat < 1:
        raise HarnessError("--repeat must be at least 1")
    backends = {name: factories[name]() for name in engines}
    measured: dict[tuple[str, str, Config], Measured] = {}
    skipped: dict[str, str] = {}
    interrupted = False
    for model in models:
        try:
            resolve(model)
        except ModelUnavailable as err:
            skipped[model] = str(err)
            warn(f"skipping {model}: {err}")
            continue
        configs = [
            c
            for c in configs_of(engines, specs, logits)
            if (c.spec != "draft-simple" or draft_for(model)) and (model, c.spec) not in skip
        ]
        progress(f"{model}: {len(configs)} sessions × {len(workloads)} workloads × {repeat} repeats")
        bench = None
        try:
            bench = ModelBench(model, configs, backends, n_predict, warn)
            bench.prepare(workloads)
            for (workload, config), m in bench.measure(workloads, repeat).items():
                measured[(model, workload, config)] = m
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep the models measured so far
            interrupted = True
            break
        finally:
            if bench is not None:
                bench.close()
    rows, aggregate = tables(measured, workloads, repeat)
    return {
        "rows": rows,
        "aggregate": aggregate,
        "parity": parity(aggregate, workloads),
        "skipped": skipped,
        "backends": backends,
        "interrupted": interrupted,
    }
