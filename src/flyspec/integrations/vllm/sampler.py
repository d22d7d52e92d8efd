"""FLy on vLLM's flattened speculative batch, between vLLM's logits processing and its own
rejection kernels.

vLLM's ``RejectionSampler.forward`` (V1 model runner) turns the target's logits into the
logits it verifies with (logits processors, temperature, top-k/top-p) and hands them to the
module-level ``rejection_sample(...)``. :class:`FlyVerifier` stands in for that function while
a FLy sampler's ``forward`` runs: it decides, per flattened draft position, what vLLM's rule
accepts (exact match for greedy requests, lossless speculative sampling with vLLM's own
uniform draws for sampled ones), lets :func:`flyspec.verify.loosely_accepted` keep some
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
from types import ModuleType

import torch

from flyspec.config import FlyConfig
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
from flyspec.verify import (
    kept_prefix,
    loosely_accepted,
    request_of_positions,
    speculative_acceptance,
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


class FlyVerifier:
    """FLy for one vLLM model runner: the rule, vLLM's sampler module it drives, and the
    count of loosely accepted tokens it emitted."""

    def __init__(self, fly: FlyConfig, *, module: ModuleType, counter: LooseCounter) -> None:
        self.fly = fly
        self.vllm = module
        self.counter = counter

    def rejection_sample(
        self,
        draft_token_ids: torch.Tensor,  # int32[T]; -1 pads a request's block
        num_draft_tokens: list[int],  # [B]
        max_spec_len: int,
        cu_num_draft_tokens: torch.Tensor,  # int32[B]
        draft_probs: torch.Tensor | None,  # [T, V], None for one-hot (greedy, n-gram) drafts
        target_logits: torch.Tensor,  # float32[T, V], as vLLM's sampler verifies with
        bonus_token_ids: torch.Tensor,  # [B, 1]
        sampling_metadata,
        synthetic_mode: bool = False,
        synthetic_conditional_rates: torch.Tensor | None = None,
        use_fp64_gumbel: bool = False,
    ) -> torch.Tensor:
        """vLLM's ``rejection_sample`` with FLy: the output ``int32[B, max_spec_len + 1]``,
        emitted tokens then ``PLACEHOLDER_TOKEN_ID``."""
        if synthetic_mode:
            raise VllmPluginError("FLy cannot be combined with synthetic rejection sampling")
        vllm_rs = self.vllm
        device = target_logits.device
        num_tokens = draft_token_ids.shape[0]
        output_token_ids = torch.full(
            (len(num_draft_tokens), max_spec_len + 1),
            vllm_rs.PLACEHOLDER_TOKEN_ID,
            dtype=torch.int32,
            device=device,
        )
        all_greedy = sampling_metadata.all_greedy
        is_greedy = None
        if not all_greedy:
            is_greedy = sampling_metadata.temperature == vllm_rs.GREEDY_TEMPERATURE
        draft_ids = draft_token_ids.long()
        index = draft_ids.clamp_min(0)[:, None]
        real_draft = draft_ids >= 0

        target_argmax = target_logits.argmax(dim=-1)  # [T]
        accepted = draft_ids == target_argmax
        allowed = real_draft & (target_logits.gather(1, index).squeeze(1) > -math.inf)
        target_probs = uniform_probs = None
        if not all_greedy:
            uniform_probs = vllm_rs.generate_uniform_probs(
                num_tokens, num_draft_tokens, sampling_metadata.generators, device
            )
            target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
            target_at_draft = target_probs.gather(1, index).squeeze(1)
            if draft_probs is None:
                draft_at_draft = torch.ones_like(target_at_draft)
            else:
                draft_at_draft = draft_probs.gather(1, index).squeeze(1)
            sampled = speculative_acceptance(target_at_draft, draft_at_draft, uniform_probs)
            greedy_position = is_greedy[request_of_positions(cu_num_draft_tokens, num_tokens)]
            accepted = torch.where(greedy_position, accepted, sampled)
            allowed &= greedy_position | (draft_at_draft > 0)
        accepted &= real_draft
        loose = loosely_accepted(
            accepted,
            target_logits,
            draft_ids,
            allowed,
            fly=self.fly,
            cu_num_drafted=cu_num_draft_tokens,
        )
        kept = accepted | loose
        self.counter.add(loose & kept_prefix(kept, cu_num_draft_tokens))

        if not sampling_metadata.all_random:
            greedy_targets = torch.where(loose, draft_ids, target_argmax)
            vllm_rs._rejection_greedy_sample(
                output_token_ids=output_token_ids,
                cu_num_draft_tokens=cu_num_draft_tokens,
                draft_token_ids=draft_token_ids,
                target_argmax=greedy_targets,
                bonus_token_ids=bonus_token_ids,
                is_greedy=is_greedy,
                max_spec_len=max_spec_len,
                uniform_probs=None,
                synthetic_conditional_rates=None,
            )
            if all_greedy:
                return output_token_ids

        recovered_token_ids = vllm_rs.sample_recovered_tokens(
            max_spec_len,
            num_draft_tokens,
            cu_num_draft_tokens,
            draft_token_ids,
            draft_probs,
            target_probs,
            sampling_metadata,
            device,
            use_fp64_gumbel,
        )
        # vLLM's kernel keeps a position when target / draft >= its draw: a draw of 0 keeps
        # it, infinity rejects it, so the kernel emits the decisions made above.
        forced_draws = torch.where(kept, 0.0, math.inf).to(uniform_probs.dtype)
        vllm_rs._rejection_random_sample(
            output_token_ids=output_token_ids,
            cu_num_draft_tokens=cu_num_draft_tokens,
            draft_token_ids=draft_token_ids,
            draft_probs=draft_probs,
            target_probs=target_probs,
            bonus_token_ids=bonus_token_ids,
            recovered_token_ids=recovered_token_ids,
            uniform_probs=forced_draws,
            is_greedy=is_greedy,
            max_spec_len=max_spec_len,
            synthetic_conditional_rates=None,
        )
        return output_token_ids


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
