"""The mutation score of a campaign: killed over compiled, non-equivalent mutants, with an exact binomial 95 %
confidence interval (scipy's Clopper-Pearson), and the HTML report of the campaign.

Survivors are judged by hand, with evidence, in `fixtures/mutation/survivors.yaml` (one entry per mutant id):
`equivalent` (it cannot change behaviour: the reason says why, e.g. a dead branch, a redundant bound, a value only
logged) leaves the denominator; `gap` stays a survivor until `closed_by` names the check, case, suite or matrix change
that kills it now.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import jinja2
import yaml
from scipy.stats import binomtest

from harness.errors import HarnessError
from harness.mutate.campaign import ERROR, KILLED, STILLBORN, SURVIVED, Campaign
from harness.paths import write_atomic
from harness.suites import suites_dir

EQUIVALENT, GAP = "equivalent", "gap"


def judgements_file() -> Path:
    """fixtures/mutation/survivors.yaml beside the suites."""
    return suites_dir().parent / "fixtures" / "mutation" / "survivors.yaml"


def load_judgements(path: Path | None = None) -> dict[str, dict]:
    """mutant id -> {verdict: equivalent | gap, reason, closed_by} (empty when the file is missing)."""
    path = path or judgements_file()
    if not path.is_file():
        return {}
    try:
        entries = yaml.safe_load(path.read_text()) or []
    except yaml.YAMLError as err:
        raise HarnessError(f"{path} is not YAML ({' '.join(str(err).split())[:200]}): fix or remove it") from None
    out = {}
    for entry in entries:
        if not isinstance(entry, dict) or entry.get("verdict") not in (EQUIVALENT, GAP) or not entry.get("id"):
            raise HarnessError(f"{path}: every entry needs an id and a verdict ({EQUIVALENT} or {GAP}): {entry!r}")
        if not entry.get("reason"):
            raise HarnessError(f"{path}: mutant {entry['id']} is judged {entry['verdict']} without a reason")
        out[str(entry["id"])] = entry
    return out


@dataclass
class Score:
    judged: int
    stillborn: int
    errors: int
    killed: int
    survived: int
    equivalent: int
    low: float | None
    high: float | None
    unreached: int = 0
    """Survivors on a line no run of the battery executes (built, not served: harness/mutate/coverage.py)."""
    peers_killed: int = 0
    peers_judged: int = 0
    """Of the compiled, non-equivalent mutants that llama.cpp's own server tests met: how many they killed."""
    peers_low: float | None = None
    peers_high: float | None = None

    @property
    def denominator(self) -> int:
        return self.killed + self.survived - self.equivalent

    @property
    def value(self) -> float | None:
        return self.killed / self.denominator if self.denominator else None

    def line(self) -> str:
        head = (
            f"{self.judged} mutants judged: {self.stillborn} stillborn, {self.errors} not judged (harness error), "
            f"{self.killed} killed, {self.survived} survived ({self.unreached} on lines no run executes, "
            f"{self.equivalent} judged equivalent)"
        )
        if self.value is None:
            return f"{head}; no score (no compiled, non-equivalent mutant)"
        line = (
            f"{head}; score {self.killed}/{self.denominator} = {100 * self.value:.1f} % "
            f"(95 % CI {100 * self.low:.1f}-{100 * self.high:.1f} %, exact binomial)"
        )
        if self.peers_judged:
            line += (
                f"; llama.cpp's own server tests: {self.peers_killed}/{self.peers_judged} = "
                f"{100 * self.peers_killed / self.peers_judged:.1f} % "
                f"(95 % CI {100 * self.peers_low:.1f}-{100 * self.peers_high:.1f} %)"
            )
        return line


def _interval(k: int, n: int) -> tuple[float | None, float | None]:
    """The exact (Clopper-Pearson) 95 % interval of k successes in n (None, None when n is 0)."""
    if not n:
        return None, None
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return ci.low, ci.high


def score(records: list[dict], judgements: dict[str, dict]) -> Score:
    statuses = Counter(r.get("status") for r in records)

    def equivalent(r: dict) -> bool:
        return r.get("status") == SURVIVED and judgements.get(r["id"], {}).get("verdict") == EQUIVALENT

    k, n = statuses[KILLED], statuses[KILLED] + statuses[SURVIVED] - sum(map(equivalent, records))
    met = [r for r in records if r.get("status") in (KILLED, SURVIVED) and not equivalent(r) and "peers" in r]
    peers_k = sum(1 for r in met if r["peers"]["killed"])
    return Score(
        len(records),
        statuses[STILLBORN],
        statuses[ERROR],
        k,
        statuses[SURVIVED],
        sum(map(equivalent, records)),
        *_interval(k, n),
        sum(1 for r in records if r.get("status") == SURVIVED and r.get("reached") is False),
        peers_k,
        len(met),
        *_interval(peers_k, len(met)),
    )


def kills_by_check(records: list[dict]) -> list[tuple[str, int]]:
    return Counter(f"{r['suite']}: {r['check']}" for r in records if r.get("status") == KILLED).most_common()


def write_report(run_dir: Path, campaign: Campaign, records: list[dict], judgements: dict[str, dict]) -> Path:
    """`mutate.html` beside the campaign: score, survivors with diffs and judgements, kills per check, every mutant."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("harness.mutate", "templates"), autoescape=True, undefined=jinja2.StrictUndefined
    )
    html = env.get_template("mutate.html.j2").render(
        campaign=campaign,
        records=records,
        score=score(records, judgements),
        kills=kills_by_check(records),
        survivors=[dict(r, judgement=judgements.get(r["id"])) for r in records if r.get("status") == SURVIVED],
        pending=len(campaign.mutants) - len(records),
    )
    target = Path(run_dir) / "mutate.html"
    write_atomic(target, lambda p: p.write_text(html))
    return target
