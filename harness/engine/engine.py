"""The in-process engine: one model, one context, N slots behind a continuous-batching scheduler."""

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from harness.engine import slot_state
from harness.engine.context import Context, ContextParams
from harness.engine.joint import joint_law
from harness.engine.model import Model
from harness.engine.scheduler import Scheduler
from harness.engine.score import replay_row, score
from harness.engine.spec_config import SpecConfig
from harness.result import Result
from harness.result.logits import PositionLogits
from harness.suites.request import Request, Sampling


def target_params(params: ContextParams, spec: SpecConfig | None) -> ContextParams:
    """The target context's options under `spec`: the recurrent snapshots per sequence (`n_rs_seq`) a partial
    rollback needs, sized as llama-server's `need_n_rs_seq()` sizes them."""
    if spec is not None and spec.enabled and spec.rollback == "partial":
        return replace(params, n_rs_seq=spec.max_draft())
    if spec is not None and spec.rollback == "auto" and spec.rs_rollback:
        return replace(params, n_rs_seq=spec.spec_draft_n_max)
    return params


class Engine:
    """Loads `model_path`, creates a context with `params` and serves requests on its slots,
    speculating when `spec` enables a drafter, logging top-k logits when `logit_top_k` > 0 and scanning
    the KV state per `kv_scan` (off, request, step)."""

    def __init__(
        self,
        model_path: Path,
        params: ContextParams,
        spec: SpecConfig | None = None,
        logit_top_k: int = 0,
        kv_scan: str = "off",
        keep_slot_states: bool = False,
    ):
        params = target_params(params, spec)
        self.model = Model(model_path, params.repack)
        self.ctx = None
        try:
            self.ctx = Context(self.model, params)
            self.scheduler = Scheduler(self.ctx, spec, logit_top_k, kv_scan)
            self.scheduler.keep_states = keep_slot_states
        except BaseException:
            self.close()
            raise

    def run(
        self,
        requests: list[Request],
        on_result: Callable[[int, Result], None] | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> list[Result]:
        """Serve the requests on the slots (concurrently when there are several); Results in order,
        each also passed to `on_result(index, result)` as soon as it finishes; `on_step` as in Scheduler.run."""
        return self.scheduler.run(requests, on_result, on_step)

    def score(self, results: list[tuple[Request, Result]]) -> list[dict]:
        """Each result's tokens scored under its request's sampler chain (harness.engine.score.score), on this
        engine's context (its slots must be idle: the scorer opens an engine of its own)."""
        return [score(self.model, self.ctx, req.sampling, res.prompt_tokens, res.tokens) for req, res in results]

    def joint_law(self, sampling: Sampling, prompt: list[int], k: int, min_mass: float) -> dict:
        """The exact law of the first k tokens after `prompt` under `sampling`'s chain (harness.engine.joint), on
        this engine's context (its slots must be idle)."""
        return joint_law(self.model, self.ctx, sampling, prompt, k, min_mass)

    def replay_row(self, decodes: list, row: int, top_k: int) -> PositionLogits:
        """Row `row` of the last of a llama-server request's replayed decodes (harness.engine.score.replay_row) on
        this engine's target context (its slots must be idle: the re-scorer opens an engine of its own)."""
        return replay_row(self.ctx, decodes, row, top_k)

    def save_slot(self, slot_id: int) -> dict:
        """The state the slot's last request left (target and draft contexts; `keep_slot_states` on), as llama-server
        answers `POST /slots/{id}?action=save`, with `state` (a harness.engine.slot_state.SavedSlot); `error`
        when there is none."""
        saved = self.scheduler.saved.get(slot_id)
        if saved is None:
            return {"error": f"slot {slot_id} holds no finished request's state (keep_slot_states off, or none ended)"}
        return {"id_slot": slot_id, "n_saved": len(saved.tokens), "n_written": saved.n_bytes, "state": saved}

    def restore_slot(self, slot_id: int, state: slot_state.SavedSlot, erase: bool = False) -> dict:
        """Restore a `save_slot` state into the slot (target and draft contexts), for its next request to reuse;
        `erase`: forget what the slot held first (the engine clears a slot's sequences at each request's end, so
        only a captured or restored state). llama-server's answer fields, or `error`."""
        if not 0 <= slot_id < len(self.scheduler.slots):
            return {"error": f"no slot {slot_id} (the engine has {len(self.scheduler.slots)})"}
        if erase:
            self.scheduler.saved.pop(slot_id, None)
            self.scheduler.restored.pop(slot_id, None)
        why = slot_state.restore(self.ctx, self.scheduler.spec, slot_id, state)
        if why is not None:
            self.scheduler.restored.pop(slot_id, None)
            return {"error": why}
        self.scheduler.restored[slot_id] = state
        return {"id_slot": slot_id, "n_restored": len(state.tokens), "n_read": state.n_bytes}

    def close(self) -> None:
        """Free the drafters, the batch, the context and the model."""
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            if scheduler.spec:
                scheduler.spec.close()
            scheduler.batch.free()
        if self.ctx is not None:
            self.ctx.close()
        self.model.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
