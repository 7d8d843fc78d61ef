"""The in-process engine: one model, one context, N slots behind a continuous-batching scheduler."""

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from harness.engine.context import Context, ContextParams
from harness.engine.model import Model
from harness.engine.scheduler import Scheduler
from harness.engine.speculative import SpecConfig
from harness.request import Request
from harness.result import Result


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
    ):
        if spec is not None and spec.enabled and spec.rollback == "partial":
            params = replace(params, n_rs_seq=spec.max_draft())
        elif spec is not None and spec.rollback == "auto" and spec.rs_rollback:  # llama-server's need_n_rs_seq()
            params = replace(params, n_rs_seq=spec.spec_draft_n_max)
        self.model = Model(model_path, params.repack)
        self.ctx = None
        try:
            self.ctx = Context(self.model, params)
            self.scheduler = Scheduler(self.ctx, spec, logit_top_k, kv_scan)
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
