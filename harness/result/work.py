"""The work a request's decoding did (`Work`): counters and steps that are deterministic and machine-independent."""

from dataclasses import dataclass

WORK_COUNTERS = (
    "target_decoded",
    "prompt_read",
    "prompt_reused",
    "ckpt_created",
    "ckpt_created_bytes",
    "ckpt_restored",
    "ckpt_restored_bytes",
    "partial_rollbacks",
    "draft_decoded",
)
"""The work a request's steps did (`Result.work`), each None where the backend cannot count it:
- `target_decoded`: tokens the target decoded for the request: its prompt tokens read, then every generation
  step's tokens, drafts and replays included;
- `prompt_read` / `prompt_reused`: prompt tokens decoded / taken from the slot's cache (llama-server's
  `prompt_n` / `cache_n`);
- `ckpt_created`, `ckpt_restored` and their `_bytes`: checkpoints of the target's sequence state saved before
  a verification and restored after a rejection (llama-server: also its prompt checkpoints, and the draft
  context's state it keeps with them);
- `partial_rollbacks`: rejections rolled back without a checkpoint (`seq_rm`: the `n_rs_seq` snapshots of a
  hybrid, the attention cells of a dense model);
- `draft_decoded`: tokens a draft model's context (or the MTP drafter's) decoded for the request (its copy of the prompt
  included)."""


CKPT_SIZE_FIELDS = ("kind", "n_tokens", "bytes")
"""The fields of one `Work.ckpt_sizes` entry."""


@dataclass
class Work:
    """The work counters of one request (WORK_COUNTERS); None: not counted by this backend."""

    target_decoded: int | None = None
    prompt_read: int | None = None
    prompt_reused: int | None = None
    ckpt_created: int | None = None
    ckpt_created_bytes: int | None = None
    ckpt_restored: int | None = None
    ckpt_restored_bytes: int | None = None
    partial_rollbacks: int | None = None
    draft_decoded: int | None = None
    ckpt_sizes: list | None = None
    """Each checkpoint the request created, `[kind, n_tokens, bytes]` (kind `prompt`: llama-server's context
    checkpoint of a prompt; `speculative`: before a verification), in order; None where not counted. Not a
    counter: the `work` check compares their sizes with each other (CHECKPOINT_KINDS), not with a baseline."""
    steps: dict | None = None
    """llama-server's steps of the request, as its log tells them (harness.backends.server_work; None elsewhere):
    `verifications` (one `[n_draft, n_accepted, speculative checkpoints created before it, their bytes, checkpoints
    restored after it, their bytes]` per verification batch, n_accepted -1 where restored), `decodes` (steps without a
    draft), `prompt_batches` (the position each batch of its prompt started at) and `prompt_restored` ([prompt
    checkpoints restored, their bytes]). Not counters: the `work` check derives from them the request's drafting
    rounds and compares the work of each request like with like (harness.checks.work `steps_of`)."""

    @classmethod
    def zero(cls) -> "Work":
        """Every counter counted, at zero (the engine counts them all)."""
        return cls(**dict.fromkeys(WORK_COUNTERS, 0), ckpt_sizes=[])

    def checkpoint(self, kind: str, n_tokens: int, nbytes: int) -> None:
        """Count one created checkpoint of `nbytes` taken at `n_tokens` positions, and keep its size."""
        self.add("ckpt_created", 1)
        self.add("ckpt_created_bytes", nbytes)
        self.ckpt_sizes = [*(self.ckpt_sizes or []), [kind, n_tokens, nbytes]]

    def add(self, name: str, n: int) -> None:
        """Add `n` to a counter (a counter not counted yet starts at 0)."""
        setattr(self, name, (getattr(self, name) or 0) + n)

    def counters(self) -> dict:
        """The counters (WORK_COUNTERS), as a baseline's work row stores them."""
        return {name: getattr(self, name) for name in WORK_COUNTERS}

    def to_dict(self) -> dict:
        """The counters and, where kept, the checkpoint sizes (a stored run's record: one {kind, n_tokens, bytes}
        per checkpoint, which a parquet column holds as a list of structs) and llama-server's steps."""
        out = self.counters()
        if self.ckpt_sizes is not None:
            out["ckpt_sizes"] = [dict(zip(CKPT_SIZE_FIELDS, c, strict=True)) for c in self.ckpt_sizes]
        if self.steps is not None:
            out["steps"] = self.steps
        return out

    @classmethod
    def from_dict(cls, data: dict | None) -> "Work":
        """A Work from `to_dict`'s record (unknown keys ignored, missing ones None)."""
        data = data or {}
        sizes = data.get("ckpt_sizes")
        if sizes is not None:
            sizes = [[c[f] for f in CKPT_SIZE_FIELDS] for c in sizes]
        return cls(**{name: data.get(name) for name in WORK_COUNTERS}, ckpt_sizes=sizes, steps=data.get("steps"))

    def counted(self) -> bool:
        """Whether any counter was counted."""
        return any(getattr(self, name) is not None for name in WORK_COUNTERS)
