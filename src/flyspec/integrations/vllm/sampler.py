"""FLy on vLLM's flattened speculative batch, between vLLM's logits processing and its own
rejection kernels.

vLLM's ``RejectionSampler.forward`` (V1 model runner) turns the target's logits into the
logits it verifies with (logits processors, temperature, top-k/top-p) and hands them to the
module-level ``rejection_sample(...)``. :class:`FlyVerifier` stands in for that function while
a FLy sampler's ``forward`` runs: it decides, per flattened draft position, what vLLM's rule
accepts (exact match for greedy requests, lossless speculative sampling with vLLM's own
uniform draws for sampled ones), lets :func:`flyspec.decoding.verify.loosely_accepted` keep some
rejected positions, and then drives vLLM's greedy and random kernels with inputs that make
them emit exactly those decisions: the argmax moved to the draft token at a loosely kept greedy
position, and draws of 0 (keep) or infinity (reject) for sampled requests. Corrections, bonus
tokens and the output layout stay vLLM's.

Shapes follow vLLM: ``T`` flattened draft positions of ``B`` requests, ``V`` vocabulary.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from flyspec.config import FlyConfig
from flyspec.decoding.verify import (
    kept_prefix,
    loosely_accepted,
    request_of_positions,
    speculative_acceptance,
)
from flyspec.integrations.vllm.metrics import LooseCounter
from flyspec.integrations.vllm.settings import (
    SECTION,
    TESTED_VLLM_VERSIONS,
    VllmPluginError,
    parse_settings,
    section_from,
    section_refused_by_native_fly,
    settings_in_force,
)

logger = logging.getLogger("vllm.flyspec")  # under vLLM's own log handler and level

SEAM_PARAMETERS = (
    "draft_token_ids",
    "num_draft_tokens",
    "max_spec_len",
    "cu_num_draft_tokens",
    "draft_probs",
    "target_logits",
    "bonus_token_ids",
    "sampling_metadata",
    "synthetic_mode",
    "synthetic_conditional_rates",
    "use_fp64_gumbel",
)
"""The parameters of ``vllm.v1.sample.rejection_sampler.rejection_sample`` the plugin
replaces (vLLM 0.32.0)."""

SEAM_HELPERS = (
    "apply_sampling_constraints",
    "apply_top_k_top_p",
    "generate_uniform_probs",
    "sample_recovered_tokens",
    "_rejection_greedy_sample",
    "_rejection_random_sample",
    "expand_batch_to_tokens",
    "PLACEHOLDER_TOKEN_ID",
    "GREEDY_TEMPERATURE",
)

KERNEL_PARAMETERS = {
    "_rejection_greedy_sample": (
        "output_token_ids",
        "cu_num_draft_tokens",
        "draft_token_ids",
        "target_argmax",
        "bonus_token_ids",
        "is_greedy",
        "max_spec_len",
        "uniform_probs",
        "synthetic_conditional_rates",
    ),
    "_rejection_random_sample": (
        "output_token_ids",
        "cu_num_draft_tokens",
        "draft_token_ids",
        "draft_probs",
        "target_probs",
        "bonus_token_ids",
        "recovered_token_ids",
        "uniform_probs",
        "is_greedy",
        "max_spec_len",
        "synthetic_conditional_rates",
    ),
}
"""The parameters of the private kernels the plugin drives (vLLM 0.32.0); it passes them by
name, and an engine whose kernels take others fails at start-up."""

_ACTIVE_VERIFIER: contextvars.ContextVar[FlyVerifier | None] = contextvars.ContextVar(
    "flyspec_active_verifier", default=None
)


def check_seam(module: ModuleType) -> None:
    """Fail loudly where vLLM's rejection sampler is not the one the plugin was tested on."""
    import vllm

    where = f"vLLM {vllm.__version__} ({module.__name__})"
    tested = ", ".join(TESTED_VLLM_VERSIONS)
    missing = [name for name in SEAM_HELPERS if not hasattr(module, name)]
    function = getattr(module, "rejection_sample", None)
    if function is None or missing:
        raise VllmPluginError(
            f"flyspec's FLy plugin cannot find its seam in {where}: missing "
            f"{', '.join(missing or ['rejection_sample'])} (tested on vLLM {tested})"
        )
    original = getattr(function, "flyspec_original", function)
    expected = {"rejection_sample": SEAM_PARAMETERS, **KERNEL_PARAMETERS}
    found = {"rejection_sample": original} | {
        name: getattr(module, name) for name in KERNEL_PARAMETERS
    }
    for name, callable_ in found.items():
        parameters = tuple(inspect.signature(callable_).parameters)
        if parameters != expected[name]:
            raise VllmPluginError(
                f"flyspec's FLy plugin does not know the {name}{parameters} of {where} "
                f"(tested on vLLM {tested})"
            )


def expand_per_request(
    values: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: float = 0,
    replace_to: float = 0,
) -> torch.Tensor:
    """``values[B]`` repeated over each request's positions: ``[B] -> [T]``, with
    ``replace_from`` replaced by ``replace_to`` first (vLLM's ``expand_batch_to_tokens``)."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    replaced = torch.where(values == replace_from, torch.full_like(values, replace_to), values)
    return replaced.repeat_interleave(counts, output_size=num_tokens)


def expansion_is_correct(expand: Callable[..., torch.Tensor]) -> bool:
    """Whether vLLM's ``expand_batch_to_tokens`` gives the right float and int32 values (on
    vLLM 0.32.0's CPU build it does not: per-token temperatures and top-k/top-p of sampled
    requests come back as uninitialised memory)."""
    cu_num_tokens = torch.tensor([1, 3, 4], dtype=torch.int32)
    for values in (torch.tensor([0.5, 0.0, 1.5]), torch.tensor([7, 0, 9], dtype=torch.int32)):
        got = expand(values, cu_num_tokens, 4, replace_from=0, replace_to=1)
        if not torch.equal(got, expand_per_request(values, cu_num_tokens, 4, 0, 1)):
            return False
    return True


def top_k_handles_empty_batches(apply_top_k_top_p: Callable[..., torch.Tensor]) -> bool:
    """Whether vLLM's top-k/top-p masking accepts a step without draft tokens (zero rows);
    vLLM 0.32.0's CPU path raises there (``max()`` of an empty tensor)."""
    try:
        apply_top_k_top_p(torch.zeros(0, 4), torch.zeros(0, dtype=torch.int32), None)
    except RuntimeError:
        return False
    return True


def empty_batch_safe(apply_sampling_constraints: Callable[..., torch.Tensor]) -> Callable:
    """vLLM's ``apply_sampling_constraints`` that leaves zero rows alone (there is nothing to
    mask in a step without draft tokens)."""

    def apply(logits: torch.Tensor, cu_num_draft_tokens: torch.Tensor, sampling_metadata):
        if logits.shape[0] == 0:
            return logits
        return apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata)

    apply.flyspec_original = apply_sampling_constraints
    return apply


@dataclass(frozen=True)
class RejectionBatch:
    """One call of vLLM's ``rejection_sample``: ``T`` flattened draft positions of ``B``
    requests, and how the requests sample."""

    draft_token_ids: torch.Tensor  # int32[T]; -1 pads a request's block
    num_draft_tokens: list[int]  # [B]
    max_spec_len: int
    cu_num_draft_tokens: torch.Tensor  # int32[B], inclusive
    draft_probs: torch.Tensor | None  # [T, V], None for one-hot (greedy, n-gram) drafts
    target_logits: torch.Tensor  # float32[T, V], as vLLM's sampler verifies with
    bonus_token_ids: torch.Tensor  # [B, 1]
    sampling_metadata: object  # vLLM's SamplingMetadata
    use_fp64_gumbel: bool = False


@dataclass(frozen=True)
class FlyDecisions:
    """What FLy decided on a :class:`RejectionBatch`, position by position.

    ``kept`` (``bool[T]``): accepted by vLLM's rule or loosely by FLy; a request emits its
    kept positions up to its first unkept one. ``loose`` (``bool[T]``): loosely accepted.
    ``target_argmax`` (``long[T]``). Where some request samples: ``target_probs``
    (``float32[T, V]``), vLLM's draws ``uniform_probs`` (``[T]``) and ``is_greedy``
    (``bool[B]``); None when every request is greedy.
    """

    kept: torch.Tensor
    loose: torch.Tensor
    target_argmax: torch.Tensor
    target_probs: torch.Tensor | None = None
    uniform_probs: torch.Tensor | None = None
    is_greedy: torch.Tensor | None = None


def sampled_acceptance(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniform_probs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's acceptance with vLLM's draws, and where the draft could draw
    its token at all (a draft probability above 0): ``long[T], [T, V] | None, [T, V], [T] ->
    (bool[T], bool[T])``. ``draft_probs`` None: one-hot drafts."""
    index = draft_ids.clamp_min(0)[:, None]
    target_at_draft = target_probs.gather(1, index).squeeze(1)
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs.gather(1, index).squeeze(1)
    accepted = speculative_acceptance(target_at_draft, draft_at_draft, uniform_probs)
    return accepted, draft_at_draft > 0


class FlyVerifier:
    """FLy for one vLLM model runner: the rule, vLLM's sampler module it drives, and the
    count of loosely accepted tokens it emitted."""

    def __init__(self, fly: FlyConfig, *, module: ModuleType, counter: LooseCounter) -> None:
        self.fly = fly
        self.vllm = module
        self.counter = counter

    def rejection_sample(
        self,
        draft_token_ids: torch.Tensor,
        num_draft_tokens: list[int],
        max_spec_len: int,
        cu_num_draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
        target_logits: torch.Tensor,
        bonus_token_ids: torch.Tensor,
        sampling_metadata,
        synthetic_mode: bool = False,
        synthetic_conditional_rates: torch.Tensor | None = None,
        use_fp64_gumbel: bool = False,
    ) -> torch.Tensor:
        """vLLM's ``rejection_sample`` with FLy (arguments as :class:`RejectionBatch`):
        :meth:`decide`, then :meth:`emit`. The output ``int32[B, max_spec_len + 1]``, emitted
        tokens then ``PLACEHOLDER_TOKEN_ID``."""
        if synthetic_mode:
            raise VllmPluginError("FLy cannot be combined with synthetic rejection sampling")
        batch = RejectionBatch(
            draft_token_ids=draft_token_ids,
            num_draft_tokens=num_draft_tokens,
            max_spec_len=max_spec_len,
            cu_num_draft_tokens=cu_num_draft_tokens,
            draft_probs=draft_probs,
            target_logits=target_logits,
            bonus_token_ids=bonus_token_ids,
            sampling_metadata=sampling_metadata,
            use_fp64_gumbel=use_fp64_gumbel,
        )
        decisions = self.decide(batch)
        self.counter.add(decisions.loose & kept_prefix(decisions.kept, cu_num_draft_tokens))
        return self.emit(batch, decisions)

    def decide(self, batch: RejectionBatch) -> FlyDecisions:
        """What vLLM's rule accepts (exact match for greedy requests, speculative sampling
        with vLLM's own draws for sampled ones), and what FLy keeps loosely of the rest."""
        metadata = batch.sampling_metadata
        target_logits = batch.target_logits
        num_tokens = batch.draft_token_ids.shape[0]
        draft_ids = batch.draft_token_ids.long()
        real_draft = draft_ids >= 0
        target_argmax = target_logits.argmax(dim=-1)  # [T]
        accepted = draft_ids == target_argmax
        at_draft = target_logits.gather(1, draft_ids.clamp_min(0)[:, None]).squeeze(1)
        allowed = real_draft & (at_draft > -math.inf)
        target_probs = uniform_probs = is_greedy = None
        if not metadata.all_greedy:
            is_greedy = metadata.temperature == self.vllm.GREEDY_TEMPERATURE
            uniform_probs = self.vllm.generate_uniform_probs(
                num_tokens, batch.num_draft_tokens, metadata.generators, target_logits.device
            )
            target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
            sampled, drawable = sampled_acceptance(
                draft_ids, batch.draft_probs, target_probs, uniform_probs
            )
            greedy_position = is_greedy[request_of_positions(batch.cu_num_draft_tokens, num_tokens)]
            accepted = torch.where(greedy_position, accepted, sampled)
            allowed &= greedy_position | drawable
        accepted &= real_draft
        loose = loosely_accepted(
            accepted,
            target_logits,
            draft_ids,
            allowed,
            fly=self.fly,
            cu_num_drafted=batch.cu_num_draft_tokens,
        )
        return FlyDecisions(
            kept=accepted | loose,
            loose=loose,
            target_argmax=target_argmax,
            target_probs=target_probs,
            uniform_probs=uniform_probs,
            is_greedy=is_greedy,
        )

    def emit(self, batch: RejectionBatch, decisions: FlyDecisions) -> torch.Tensor:
        """vLLM's greedy and random kernels emitting ``decisions``: the output
        ``int32[B, max_spec_len + 1]``. Corrections, bonus tokens and the layout stay
        vLLM's."""
        output_token_ids = torch.full(
            (len(batch.num_draft_tokens), batch.max_spec_len + 1),
            self.vllm.PLACEHOLDER_TOKEN_ID,
            dtype=torch.int32,
            device=batch.target_logits.device,
        )
        metadata = batch.sampling_metadata
        if not metadata.all_random:
            self._emit_greedy(batch, decisions, output_token_ids)
            if metadata.all_greedy:
                return output_token_ids
        self._emit_sampled(batch, decisions, output_token_ids)
        return output_token_ids

    def _emit_greedy(
        self, batch: RejectionBatch, decisions: FlyDecisions, output_token_ids: torch.Tensor
    ) -> None:
        """The greedy requests' tokens, with the argmax moved to the draft token at each
        loosely kept position."""
        draft_ids = batch.draft_token_ids.long()
        self.vllm._rejection_greedy_sample(
            output_token_ids=output_token_ids,
            cu_num_draft_tokens=batch.cu_num_draft_tokens,
            draft_token_ids=batch.draft_token_ids,
            target_argmax=torch.where(decisions.loose, draft_ids, decisions.target_argmax),
            bonus_token_ids=batch.bonus_token_ids,
            is_greedy=decisions.is_greedy,
            max_spec_len=batch.max_spec_len,
            uniform_probs=None,
            synthetic_conditional_rates=None,
        )

    def _emit_sampled(
        self, batch: RejectionBatch, decisions: FlyDecisions, output_token_ids: torch.Tensor
    ) -> None:
        """The sampled requests' tokens, the kept positions forced through vLLM's draws."""
        recovered_token_ids = self.vllm.sample_recovered_tokens(
            batch.max_spec_len,
            batch.num_draft_tokens,
            batch.cu_num_draft_tokens,
            batch.draft_token_ids,
            batch.draft_probs,
            decisions.target_probs,
            batch.sampling_metadata,
            batch.target_logits.device,
            batch.use_fp64_gumbel,
        )
        # vLLM's kernel keeps a position when target / draft >= its draw: a draw of 0 keeps
        # it, infinity rejects it, so the kernel emits the decisions made above.
        forced_draws = torch.where(decisions.kept, 0.0, math.inf)
        self.vllm._rejection_random_sample(
            output_token_ids=output_token_ids,
            cu_num_draft_tokens=batch.cu_num_draft_tokens,
            draft_token_ids=batch.draft_token_ids,
            draft_probs=batch.draft_probs,
            target_probs=decisions.target_probs,
            bonus_token_ids=batch.bonus_token_ids,
            recovered_token_ids=recovered_token_ids,
            uniform_probs=forced_draws.to(decisions.uniform_probs.dtype),
            is_greedy=decisions.is_greedy,
            max_spec_len=batch.max_spec_len,
            synthetic_conditional_rates=None,
        )


def dispatching_rejection_sample(original: Callable[..., torch.Tensor]) -> Callable:
    """``rejection_sample`` that runs the active :class:`FlyVerifier` while a FLy sampler's
    ``forward`` is on the stack, and vLLM's ``original`` otherwise."""

    def rejection_sample(*args, **kwargs):
        verifier = _ACTIVE_VERIFIER.get()
        if verifier is None:
            return original(*args, **kwargs)
        return verifier.rejection_sample(*args, **kwargs)

    rejection_sample.flyspec_original = original
    return rejection_sample


def current_additional_config() -> dict | None:
    """vLLM's ``additional_config`` of the engine being built (vLLM builds its samplers
    inside its ``set_current_vllm_config`` context), or None outside such a context (a
    sampler built by hand): then only ``FLYSPEC_VLLM`` can switch FLy on."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return None if config is None else dict(config.additional_config or {})


def build_verifier(
    spec_config, device: torch.device | None, *, module: ModuleType | None = None
) -> FlyVerifier | None:
    """The verifier a V1 rejection sampler of this engine runs, or None where the engine's
    settings leave verification exact. Every check that can fail happens here, at start-up.

    ``device``: the sampler's (None: the platform's). ``module``: vLLM's rejection sampler
    module (its default), which the verifier drives and the plugin may patch."""
    fly = settings_in_force(current_additional_config())
    if fly is None:
        return None
    import vllm

    if module is None:
        from vllm.v1.sample import rejection_sampler as module
    vllm_rs = module

    check_seam(vllm_rs)
    if spec_config is not None and spec_config.rejection_sample_method != "standard":
        raise VllmPluginError(
            "FLy replaces vLLM's standard rejection sampling; it cannot be combined with "
            f"rejection_sample_method={spec_config.rejection_sample_method!r}"
        )
    if vllm.__version__ not in TESTED_VLLM_VERSIONS:
        logger.warning(
            "flyspec's FLy plugin is tested on vLLM %s; this is vLLM %s",
            ", ".join(TESTED_VLLM_VERSIONS),
            vllm.__version__,
        )
    num_speculative = getattr(spec_config, "num_speculative_tokens", None)
    if num_speculative is not None and num_speculative <= fly.window:
        logger.warning(
            "FLy never loosens a token here: the window (%d) must fit inside the block of %d "
            "speculative tokens after the mismatch",
            fly.window,
            num_speculative,
        )
    if getattr(vllm_rs.rejection_sample, "flyspec_original", None) is None:
        vllm_rs.rejection_sample = dispatching_rejection_sample(vllm_rs.rejection_sample)
    if runs_on_cpu(device):
        work_around_cpu_bugs(vllm_rs)
    logger.info(
        "flyspec FLy on: window %d, theta %s, %s entropy (additional_config['%s'])",
        fly.window,
        fly.theta,
        fly.entropy,
        SECTION,
    )
    return FlyVerifier(fly, module=vllm_rs, counter=LooseCounter.for_this_process())


def runs_on_cpu(device: torch.device | None) -> bool:
    """Whether a sampler on ``device`` (None: the platform's) runs vLLM's CPU kernels."""
    if device is not None:
        return torch.device(device).type == "cpu"
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def work_around_cpu_bugs(vllm_rs: ModuleType) -> None:
    """Replace the helpers of vLLM's CPU build that give wrong results (docs/vllm.md). The
    probes feed host tensors, which only the CPU build's helpers take: vLLM's Triton helpers
    on an accelerator refuse them."""
    if not expansion_is_correct(vllm_rs.expand_batch_to_tokens):
        logger.warning(
            "vLLM's expand_batch_to_tokens returns wrong per-token temperatures and "
            "top-k/top-p on this platform; flyspec's FLy plugin expands them with torch"
        )
        vllm_rs.expand_batch_to_tokens = expand_per_request
    if not top_k_handles_empty_batches(vllm_rs.apply_top_k_top_p) and not hasattr(
        vllm_rs.apply_sampling_constraints, "flyspec_original"
    ):
        logger.warning(
            "vLLM's top-k/top-p masking fails on a step without draft tokens on this "
            "platform; flyspec's FLy plugin skips the masking of such empty steps"
        )
        vllm_rs.apply_sampling_constraints = empty_batch_safe(vllm_rs.apply_sampling_constraints)


def fly_sampler_class(base: type) -> type:
    """vLLM's V1 ``RejectionSampler`` with FLy switched on by the engine's settings."""

    class FlyRejectionSampler(base):
        def __init__(self, sampler, spec_config=None, device=None):
            super().__init__(sampler, spec_config, device)
            self.flyspec_verifier = build_verifier(spec_config, device)

        def forward(self, *args, **kwargs):
            if self.flyspec_verifier is None:
                return super().forward(*args, **kwargs)
            token = _ACTIVE_VERIFIER.set(self.flyspec_verifier)
            try:
                return super().forward(*args, **kwargs)
            finally:
                _ACTIVE_VERIFIER.reset(token)

    FlyRejectionSampler.__qualname__ = FlyRejectionSampler.__name__ = base.__name__
    FlyRejectionSampler.flyspec_base = base
    return FlyRejectionSampler


def refusing_sampler_class(base: type) -> type:
    """vLLM's V2 model runner's ``RejectionSampler``, refusing to start where the plugin's
    settings ask for FLy (its sampler path is not the one the plugin drives). On a vLLM with
    FLy built in, any ``flyspec`` section stops the start-up with the native keys to use."""

    class V2RejectionSampler(base):
        def __init__(self, *args, **kwargs):
            section = section_from(current_additional_config(), os.environ)
            if section is not None:
                from flyspec.integrations.vllm.launch import native_fly_version

                if (version := native_fly_version()) is not None:
                    raise section_refused_by_native_fly(section, vllm_version=version)
                if parse_settings(section) is not None:
                    raise VllmPluginError(
                        "flyspec's FLy runs on vLLM's V1 model runner, and this engine uses "
                        "the V2 one: start vLLM with VLLM_USE_V2_MODEL_RUNNER=0"
                    )
            super().__init__(*args, **kwargs)

    V2RejectionSampler.__qualname__ = V2RejectionSampler.__name__ = base.__name__
    V2RejectionSampler.flyspec_base = base
    return V2RejectionSampler
