"""The named speculative configs: each preset is a `--spec-type` value of llama-server with parameters sized
for the tiny models, plus in-process-only scripted ones and a llama-server-only synthetic one that force rejections;
and how a preset's options are served."""

from dataclasses import dataclass

from harness.errors import HarnessError


@dataclass(frozen=True)
class SpecPreset:
    """A named speculative configuration."""

    options: dict
    """llama-server flag names (without dashes) → values; empty for `none`."""
    scripted: str | None = None
    """In-process only: `accept-all`, `reject-all` or `wrong-at-2` drafts from the case's own greedy output."""
    expect_accepts: bool = True
    """Whether `spec-ran` expects some drafts accepted (a forced-rejection config does not)."""
    rejects_all: bool = False
    """Forced rejection: every draft is rejected, so `spec-ran` requires drafts and no accepted token in every
    request (vLLM's forced-rejection test asserts the same)."""
    server_only: bool = False
    """llama-server only: options the in-process engine does not have (synthetic acceptance)."""
    draft: str = "draft"
    """Which registered draft of the target draft-simple serves (harness.models.draft_for): `draft`, its usual one,
    or `close-draft`, a closer copy of the target (accepted most of the time)."""

    @property
    def speculative(self) -> bool:
        return bool(self.options) or self.scripted is not None

    @property
    def keeps_seeded_tokens(self) -> bool:
        """`keeps_seeded_tokens` of the preset's options."""
        return keeps_seeded_tokens(self.options)

    def runs_on(self, backend: str) -> bool:
        """Whether `backend` has this config: scripted ones are in-process only, `server_only` ones llama-server's."""
        return not (self.scripted and backend == "server") and not (self.server_only and backend == "inproc")

    @property
    def learns_across_requests(self) -> bool:
        """Whether a drafter keeps state from one request to the next (ngram-map-k / -k4v per slot, ngram-mod
        shared by all): its acceptance depends on which requests a slot served before, so it compares only
        with a run that served them in the same order."""
        return bool(set(str(self.options.get("spec-type", "")).split(",")) & LEARNING_DRAFTERS)


def served_options(preset: SpecPreset, overrides: dict) -> dict:
    """The llama-server options a cell of `preset` is served with under a run's `--spec-*` overrides (none for a
    preset without options: `none` and the scripted ones)."""
    return {**preset.options, **overrides} if preset.options else {}


OPTION_DEFAULTS = {"spec-draft-sampling": "greedy"}
"""llama-server's value of a speculative option it is not given: an option set to it serves as the option left out."""


def canonical(options: dict) -> tuple:
    """Speculative options as served: sorted, values as text, an option at its default left out."""
    return tuple(sorted((k, str(v)) for k, v in options.items() if OPTION_DEFAULTS.get(k) != v))


def served_as(spec: str, overrides: dict) -> tuple:
    """What a spec config is served as under a run's `--spec-*` overrides: its options and its script. Two configs
    with the same value are served alike (`draft-simple-probabilistic` with `--spec-draft-sampling greedy` is
    `draft-simple`); the draft they serve is part of it (`draft-simple-close` is not `draft-simple`)."""
    preset = spec_preset(spec)
    return canonical(served_options(preset, overrides)), preset.scripted, preset.draft


def keeps_seeded_tokens(options: dict) -> bool:
    """False under rejection sampling (`--spec-draft-sampling probabilistic`): at temperature > 0 a drafted token is
    accepted with probability min(1, p/q) and a rejected one redrawn from the residual, so the output keeps the
    target's distribution but not the non-speculative run's seeded tokens. `options`: the speculative options a
    cell was served with (its preset's, with the run's `--spec-*` overrides)."""
    return options.get("spec-draft-sampling", "greedy") != "probabilistic"


LEARNING_DRAFTERS = {"ngram-map-k", "ngram-map-k4v", "ngram-mod"}
"""The `--spec-type` drafters whose state outlives a request."""

_NGRAM_SMALL = {
    "ngram-simple": {"spec-ngram-simple-size-n": 3, "spec-ngram-simple-size-m": 8},
    "ngram-map-k": {"spec-ngram-map-k-size-n": 3, "spec-ngram-map-k-size-m": 8},
    "ngram-map-k4v": {"spec-ngram-map-k4v-size-n": 3, "spec-ngram-map-k4v-size-m": 8},
    "ngram-mod": {"spec-ngram-mod-n-match": 3, "spec-ngram-mod-n-min": 1, "spec-ngram-mod-n-max": 8},
}
SPEC_PRESETS: dict[str, SpecPreset] = {
    "none": SpecPreset({}),
    "draft-simple": SpecPreset({"spec-type": "draft-simple", "spec-draft-n-max": 4}),
    # the draft context's K cache in q8_0 while the target's stays f16 (a quantized V needs flash attention)
    "draft-simple-q8": SpecPreset({"spec-type": "draft-simple", "spec-draft-n-max": 4, "spec-draft-type-k": "q8_0"}),
    **{name: SpecPreset({"spec-type": name, **opts}) for name, opts in _NGRAM_SMALL.items()},
    # lookup decoding from the slot's own 1..4-gram counts (no -lcs / -lcd cache files; up to 8 tokens, hard-coded)
    "ngram-cache": SpecPreset({"spec-type": "ngram-cache"}),
    # the target's own MTP (nextn) head drafts (a model with `nextn_predict_layers`: tiny-hybrid-mtp); a hybrid
    # target rolls back inside 3 recurrent snapshots on both backends (llama-server's need_n_rs_seq)
    "draft-mtp": SpecPreset({"spec-type": "draft-mtp", "spec-draft-n-max": 3}),
    # draft heads fed with the target's hidden states, generated for tiny-hybrid-mtp (`-md` its `<model>-eagle3` /
    # `-dflash` / `-dspark`), on both backends. The tiny DFlash head's block is 2 (the anchor and one mask slot),
    # so llama-server clamps its drafts to 1 token (block_size - 1). EAGLE3 stops drafting below a top probability
    # of 0.2 (`--spec-draft-p-min`, which its drafter reads at every step): its 2nd and 3rd tokens mix the previous
    # token into the residual and are mostly wrong (quicksort seq, C + Java + Python: 33 of 168 accepted at p-min 0,
    # 26 of 80 at 0.2)
    "draft-eagle3": SpecPreset({"spec-type": "draft-eagle3", "spec-draft-n-max": 3, "spec-draft-p-min": 0.2}),
    "draft-dflash": SpecPreset({"spec-type": "draft-dflash", "spec-draft-n-max": 3}),
    "draft-dspark": SpecPreset({"spec-type": "draft-dspark", "spec-draft-n-max": 3}),
    "scripted-accept": SpecPreset({}, scripted="accept-all"),
    # every draft rejected: a draft-simple draft is synthetically accepted with probability 0 (`--spec-synth-len 1`
    # resolves to rates 0,…,0 for any n_max); the target's token is still sampled and emitted, so the output is
    # the non-speculative one while every step rolls back (hybrid / recurrent targets: a checkpoint restore)
    "synth-reject": SpecPreset(
        {"spec-type": "draft-simple", "spec-draft-n-max": 4, "spec-synth-len": 1},
        expect_accepts=False,
        rejects_all=True,
        server_only=True,
    ),
    # the same over the target's own MTP head (tiny-hybrid-mtp): every step rolls back inside the target's recurrent
    # snapshots (`n_rs_seq` 3, partial rollback) and the MTP context's KV, never through a checkpoint
    "synth-reject-mtp": SpecPreset(
        {"spec-type": "draft-mtp", "spec-draft-n-max": 3, "spec-synth-len": 1},
        expect_accepts=False,
        rejects_all=True,
        server_only=True,
    ),
    # synthetic acceptance at known rates: draft position i of a draft-simple draft is accepted with unconditional
    # probability P_i (llama-server draws each position's decision from a per-slot std::mt19937 seeded with the
    # request's seed, at conditional rate P_i / P_{i-1}), whatever the target says: the output is not the target's
    # (`lossless` and `baseline` are not run); `synth-acceptance` tests the counts against the rates
    "synth-rates": SpecPreset(
        {"spec-type": "draft-simple", "spec-draft-n-max": 4, "spec-synth-rates": "0.9,0.7,0.5,0.3"},
        server_only=True,
    ),
    # drafting stops at a token whose top-10 probability is below p_min: many short drafts, some rejected. The tiny
    # models' counterpart of upstream's `--spec-draft-p-min 0.99` (their drafts' top-10 probabilities lie in
    # 0.12-0.59, median 0.2: at 0.99 they never draft)
    "draft-p-min-0.2": SpecPreset({"spec-type": "draft-simple", "spec-draft-n-max": 4, "spec-draft-p-min": 0.2}),
    # the same with drafts of one token dropped (`--spec-draft-n-min 2`): every verified draft holds 2 to 4 tokens
    # (`draft-size`); in par the slots draft in one batch, where llama-server drops each slot's short draft
    "draft-p-min-0.2-n-min-2": SpecPreset(
        {"spec-type": "draft-simple", "spec-draft-n-max": 4, "spec-draft-p-min": 0.2, "spec-draft-n-min": 2}
    ),
    "scripted-reject": SpecPreset({}, scripted="reject-all", expect_accepts=False, rejects_all=True),
    # rejection sampling (llama.cpp b11434 and newer; an older llama-server has no --spec-draft-sampling, and its
    # cells are not run): at temperature > 0 the draft samples at the target's temperature and the target accepts
    # a drafted token with probability min(1, p/q); greedy requests verify as draft-simple does
    "draft-simple-probabilistic": SpecPreset(
        {"spec-type": "draft-simple", "spec-draft-n-max": 4, "spec-draft-sampling": "probabilistic"},
    ),
    # a draft that agrees with the target most of the time (`<model>-close-draft`, noise 0.005; at temperature 0.05
    # accepted 75-98 % of its drafted tokens: suites/sampling-close.yaml), so whole drafts are accepted at most steps
    "draft-simple-close": SpecPreset({"spec-type": "draft-simple", "spec-draft-n-max": 4}, draft="close-draft"),
    "draft-simple-close-probabilistic": SpecPreset(
        {"spec-type": "draft-simple", "spec-draft-n-max": 4, "spec-draft-sampling": "probabilistic"},
        draft="close-draft",
    ),
    "draft-mtp-probabilistic": SpecPreset(
        {"spec-type": "draft-mtp", "spec-draft-n-max": 3, "spec-draft-sampling": "probabilistic"},
    ),
    "scripted-wrong-at-2": SpecPreset({}, scripted="wrong-at-2"),
}


def spec_preset(name: str) -> SpecPreset:
    """A preset by name; `a+b` chains the drafters of several `--spec-type` presets (first draft wins)."""
    parts = [p for p in name.split("+") if p]
    unknown = [p for p in parts if p not in SPEC_PRESETS]
    if unknown or not parts:
        raise HarnessError(f"unknown spec config '{name}' (known: {', '.join(SPEC_PRESETS)})")
    if len(parts) == 1:
        return SPEC_PRESETS[parts[0]]
    if any(SPEC_PRESETS[p].options.get("spec-type") != p for p in parts):
        raise HarnessError(f"spec config '{name}': only presets named after their --spec-type combine")
    options: dict = {}
    for p in parts:
        options.update({k: v for k, v in SPEC_PRESETS[p].options.items() if k != "spec-type"})
    return SpecPreset({"spec-type": ",".join(parts), **options})
