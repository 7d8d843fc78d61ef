"""The work a run's requests did, read from stored records (`work` in results.json, harness.result.WORK_COUNTERS):
summed per cell, per generated token, and as the short text the run summary, `index.html`, `diff` and `bench` show
beside acceptance and speed-up.

A counter is None for a group of requests where one of them has it not counted: llama-server counts no draft
decodes, and target decodes only where the request's log was read whole (harness.backends.server_work); records
written before work was recorded have none.
"""

from harness.result import WORK_COUNTERS

MORE_IS_WORSE = tuple(c for c in WORK_COUNTERS if c != "prompt_reused")
"""The counters where more is more work, as the `work` check has them (`prompt_reused` is work saved: a prompt read
again shows in `prompt_read` and `target_decoded`)."""
BYTES = ("ckpt_created_bytes", "ckpt_restored_bytes")
LABELS = {
    "target_decoded": "target tokens decoded",
    "prompt_read": "prompt tokens read",
    "prompt_reused": "prompt tokens reused",
    "ckpt_created": "checkpoints created",
    "ckpt_created_bytes": "checkpoint bytes created",
    "ckpt_restored": "checkpoints restored",
    "ckpt_restored_bytes": "checkpoint bytes restored",
    "partial_rollbacks": "partial rollbacks",
    "draft_decoded": "draft tokens decoded",
}
"""What each counter counts, in words (table headers)."""


def totals(rows: list[dict]) -> dict:
    """Each work counter summed over some request records (None where one of them did not count it), with the
    requests and their generated tokens (`generated`)."""
    out: dict = {"requests": len(rows), "generated": sum(len(r.get("tokens") or []) for r in rows)}
    for name in WORK_COUNTERS:
        values = [(r.get("work") or {}).get(name) for r in rows]
        out[name] = None if not values or any(v is None for v in values) else sum(values)
    return out


def counted(t: dict) -> bool:
    """Whether some counter of `totals` was counted."""
    return any(t.get(name) is not None for name in WORK_COUNTERS)


def per_token(t: dict) -> dict:
    """Each counter of `totals` per generated token (None where not counted or nothing was generated)."""
    g = t.get("generated") or 0
    return {name: t[name] / g if t.get(name) is not None and g else None for name in WORK_COUNTERS}


def size(n_bytes: float | None) -> str:
    """Bytes as llama-server prints checkpoint sizes: KiB under one MiB, else MiB."""
    if n_bytes is None:
        return "—"
    if n_bytes < 2**20:
        return f"{n_bytes / 2**10:.0f} KiB" if n_bytes else "0"
    return f"{n_bytes / 2**20:.1f} MiB"


def value(name: str, x: float | None) -> str:
    """One counter's value (a total or per generated token) as a table shows it."""
    if x is None:
        return "—"
    if name in BYTES:
        return size(x)
    return str(x) if isinstance(x, int) else f"{x:.3g}"


def text(t: dict, short: bool = False) -> str:
    """The work of `totals` in a line: `1.31 target dec/tok · ckpt 34 / 3.0 MiB, 12 restored / 1.1 MiB · 25 partial
    rollbacks · prompt 130 read / 68 reused · 2.10 draft dec/tok`; `short` (the run summary's column): target
    decodes per generated token and the checkpoints and rollbacks only, zeros left out but the checkpoints'.
    `not counted` where no counter was."""
    if not counted(t):
        return "not counted"
    per = per_token(t)
    parts = []
    if per["target_decoded"] is not None:
        parts.append(f"{per['target_decoded']:.2f} {'dec' if short else 'target dec'}/tok")
    if t["ckpt_created"] is not None:
        ckpt = f"ckpt {t['ckpt_created']}" + (f" / {size(t['ckpt_created_bytes'])}" if t["ckpt_created"] else "")
        if t["ckpt_restored"]:
            ckpt += f", {t['ckpt_restored']} restored" + ("" if short else f" / {size(t['ckpt_restored_bytes'])}")
        parts.append(ckpt)
    if t["partial_rollbacks"] is not None and (t["partial_rollbacks"] or not short):
        parts.append(f"{t['partial_rollbacks']} partial" + ("" if short else " rollbacks"))
    if not short:
        if t["prompt_read"] is not None:
            parts.append(f"prompt {t['prompt_read']} read / {t['prompt_reused'] or 0} reused")
        if per["draft_decoded"] is not None and t["draft_decoded"]:
            parts.append(f"{per['draft_decoded']:.2f} draft dec/tok")
    return " · ".join(parts)


def compare(rows_a: list[dict], rows_b: list[dict], threshold: float = 0.0) -> dict:
    """The work of the same requests in two runs (A before, B after), per counter: totals, per generated token, and
    whether it grew (B's per generated token above A's by more than `threshold`, relative; counted exactly, so 0
    flags any growth; `prompt_reused` is work saved and never grows). `grew` lists the counters that did."""
    ta, tb = totals(rows_a), totals(rows_b)
    pa, pb = per_token(ta), per_token(tb)
    counters = []
    for name in WORK_COUNTERS:
        a, b = ta[name], tb[name]
        known = a is not None and b is not None and ta["generated"] and tb["generated"]
        # B's count per generated token above A's, compared as integers (no float rounding at threshold 0)
        grew = bool(known and name in MORE_IS_WORSE and b * ta["generated"] > a * tb["generated"] * (1 + threshold))
        change = (pb[name] / pa[name] - 1 if pa[name] else None) if known else None
        counters.append(
            {
                "counter": name,
                "a": a,
                "b": b,
                "a_per_token": pa[name],
                "b_per_token": pb[name],
                "change": change,
                "grew": grew,
            }
        )
    return {"a": ta, "b": tb, "counters": counters, "grew": [c["counter"] for c in counters if c["grew"]]}


def change_text(c: dict) -> str:
    """`+12 %`, `from 0` or `=` for one counter of `compare`."""
    if c["a_per_token"] is None or c["b_per_token"] is None:
        return "not counted"
    if c["change"] is None:
        return "from 0" if c["b_per_token"] else "="
    return "=" if c["change"] == 0 else f"{c['change']:+.0%}"
