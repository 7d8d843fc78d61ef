"""The in-process backend: our own engine on llama-cpp-python, behind the Backend protocol."""

from harness.backends.base import ServeConfig
from harness.engine import ContextParams, Engine
from harness.engine.speculative import SpecConfig
from harness.request import Request
from harness.result import Result


def context_params(config: ServeConfig) -> ContextParams:
    """The engine's context options for a serve config (`seq` = 1 slot; `par` = unified KV)."""
    return ContextParams(
        n_ctx=config.n_ctx,
        n_batch=config.n_batch,
        n_ubatch=config.n_ubatch,
        parallel=config.n_slots,
        kv_unified=config.kv_unified,
        flash_attn=config.flash_attn,
        cache_type_k=config.cache_type_k,
        cache_type_v=config.cache_type_v,
        threads=config.threads,
        seed=config.seed,
    )


def spec_config(config: ServeConfig) -> SpecConfig:
    """The engine's speculative options from llama-server style names plus the in-process extras."""
    options = dict(config.engine)
    drafters = options.pop("drafters", [])
    spec = SpecConfig.from_options({**config.spec, "spec-draft-model": config.draft_model, **options})
    spec.drafters = list(drafters)
    return spec


class InprocSession:
    """An Engine serving one model in one mode."""

    def __init__(self, config: ServeConfig):
        self.engine = Engine(config.model, context_params(config), spec_config(config), config.logit_top_k,
                             config.kv_scan)

    def run(self, requests: list[Request]) -> list[Result]:
        return self.engine.run(requests)

    def close(self) -> None:
        self.engine.close()


class InprocBackend:
    """`--backend inproc`."""

    name = "inproc"

    def environment(self) -> dict:
        """llama-cpp-python's version and whether its build offloads to a GPU."""
        import importlib.metadata

        import llama_cpp

        return {
            "device": "gpu" if llama_cpp.llama_supports_gpu_offload() else "cpu",
            "llama_cpp_python": importlib.metadata.version("llama-cpp-python"),
        }

    def open(self, config: ServeConfig) -> InprocSession:
        return InprocSession(config)
