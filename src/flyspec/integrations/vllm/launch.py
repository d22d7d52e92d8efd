"""vLLM engines for flyspec's settings: the ``vllm serve`` command line of ``flyspec serve
--engine vllm`` and the ``vllm.LLM`` arguments of ``flyspec bench --engine vllm``.

One :class:`VllmEngineSpec` maps flyspec's decoding settings onto vLLM's: the mode chooses
between no speculation (``target``), vLLM's exact verification (``spd``) and FLy (``fly``);
the drafter is vLLM's ``draft_model`` or ``ngram`` proposer with ``k`` speculative tokens.
FLy is vLLM's own where the installed vLLM has it built in (:func:`native_fly_version`, 0.34
and later: ``speculative_config`` keys), and flyspec's plugin elsewhere (``additional_config``).
Nothing here imports vLLM at module load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flyspec.config import DEFAULT_MAX_NGRAM, FlyConfig
from flyspec.errors import FlyspecError
from flyspec.integrations.vllm.settings import additional_config, native_speculative_keys

ENGINE_MODES = ("target", "spd", "fly")
ENGINE_DRAFTERS = ("model", "ngram")
DEFAULT_CPU_KVCACHE_GIB = "4"
SETUP_HINT = (
    "vLLM is not installed in this environment: run `bash scripts/setup.sh --vllm` and use "
    ".venv-vllm/bin/flyspec, or install flyspec into vLLM's environment "
    "(pip install 'flyspec[vllm]')"
)


NATIVE_FLY_FIELDS = frozenset({"fly_window_size", "fly_entropy_threshold", "fly_entropy_top_k"})
"""The fields of vLLM's ``SpeculativeConfig`` that show FLy built in (vLLM 0.34 and later)."""


def config_fields(config_class: type) -> frozenset[str]:
    """The field names of one of vLLM's config classes (pydantic dataclasses)."""
    if dataclasses.is_dataclass(config_class):
        return frozenset(field.name for field in dataclasses.fields(config_class))
    return frozenset(getattr(config_class, "model_fields", {}))


def native_fly_version() -> str | None:
    """The installed vLLM's version where its ``SpeculativeConfig`` has FLy built in, else
    None (then flyspec's plugin runs FLy). Read from the config's fields, not the version."""
    import vllm
    from vllm.config import SpeculativeConfig

    if config_fields(SpeculativeConfig) >= NATIVE_FLY_FIELDS:
        return vllm.__version__
    return None


def require_vllm() -> None:
    """FlyspecError with the setup hint where vLLM cannot be imported."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise FlyspecError(SETUP_HINT) from None


@dataclass(frozen=True)
class VllmEngineSpec:
    """One vLLM engine: which models, and how it speculates and verifies."""

    target: str
    draft: str | None = None
    mode: str = "fly"
    drafter: str = "model"
    k: int = 15
    fly: FlyConfig = field(default_factory=FlyConfig)
    dtype: str | None = None  # None: vLLM's choice (the checkpoint's dtype)
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    max_num_seqs: int | None = None
    prefix_caching: bool | None = None  # None: vLLM's default (on)
    seed: int = 0
    native_fly: str | None = None  # the version of a vLLM with FLy built in; None: the plugin

    def __post_init__(self) -> None:
        if self.mode not in ENGINE_MODES:
            raise FlyspecError(f"mode must be one of {', '.join(ENGINE_MODES)} with vLLM")
        if self.mode != "target" and self.drafter not in ENGINE_DRAFTERS:
            raise FlyspecError(
                f"vLLM's proposers here are {', '.join(ENGINE_DRAFTERS)}; the {self.drafter!r} "
                "drafter runs in flyspec's own engine only"
            )
        if self.mode != "target" and self.drafter == "model" and not self.draft:
            raise FlyspecError("speculative decoding with the model drafter needs a draft model")
        if self.tensor_parallel_size < 1:
            raise FlyspecError(
                f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}"
            )
        self.speculative_config()  # refuses a rule that vLLM's own FLy has no equivalent of

    def proposer(self) -> dict | None:
        """The proposer part of ``speculative_config`` (None: no speculation)."""
        if self.mode == "target":
            return None
        if self.drafter == "ngram":
            return {
                "method": "ngram",
                "num_speculative_tokens": self.k,
                "prompt_lookup_max": DEFAULT_MAX_NGRAM,
                "prompt_lookup_min": 1,
            }
        return {"method": "draft_model", "model": self.draft, "num_speculative_tokens": self.k}

    def speculative_config(self) -> dict | None:
        """vLLM's ``speculative_config``: the proposer, and vLLM's own FLy where it has one."""
        proposer = self.proposer()
        if proposer is not None and self.mode == "fly" and self.native_fly:
            proposer |= native_speculative_keys(self.fly, vllm_version=self.native_fly)
            window = proposer.get("fly_window_size", 0)
            if window >= self.k:
                raise FlyspecError(
                    f"--window {window} does not fit in the block of -k {self.k}: vLLM "
                    f"{self.native_fly}'s built-in FLy needs the window below K (W exact "
                    "matches after the mismatch, inside the block)"
                )
        return proposer

    def additional_config(self) -> dict:
        """The plugin's section: FLy's rule in ``fly`` mode on a vLLM without FLy built in,
        nothing otherwise (vLLM's own verification, the plugin idle)."""
        return additional_config(self.fly) if self.mode == "fly" and not self.native_fly else {}

    def llm_kwargs(self) -> dict:
        """Keyword arguments of ``vllm.LLM``."""
        kwargs: dict = {
            "model": self.target,
            "tensor_parallel_size": self.tensor_parallel_size,
            "seed": self.seed,
            "disable_log_stats": False,  # LLM.get_metrics() needs the stat loggers
        }
        optional = {
            "speculative_config": self.speculative_config(),
            "additional_config": self.additional_config() or None,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "enable_prefix_caching": self.prefix_caching,
        }
        kwargs.update({key: value for key, value in optional.items() if value is not None})
        if on_cpu():
            kwargs["enforce_eager"] = True
        return kwargs

    def serve_arguments(self) -> list[str]:
        """The server arguments of this engine, the target model excepted."""
        arguments = []
        if (speculative := self.speculative_config()) is not None:
            arguments += ["--speculative-config", json.dumps(speculative)]
        if additional := self.additional_config():
            arguments += ["--additional-config", json.dumps(additional)]
        if self.dtype:
            arguments += ["--dtype", self.dtype]
        if self.max_model_len:
            arguments += ["--max-model-len", str(self.max_model_len)]
        if self.max_num_seqs:
            arguments += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.tensor_parallel_size > 1:
            arguments += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if on_cpu():
            arguments.append("--enforce-eager")
        return arguments


def on_cpu() -> bool:
    """Whether the installed vLLM runs on the CPU (its CPU build)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a vLLM engine starts with. On the CPU, unless set: a KV cache space of
    4 GiB (``VLLM_CPU_KVCACHE_SPACE``), and every core computing
    (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``; vLLM otherwise keeps one core for its front end,
    half of a 2-core machine, see docs/vllm.md)."""
    environment = dict(environ)
    if on_cpu():
        environment.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)
        environment.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return environment


def serve_command(
    spec: VllmEngineSpec,
    *,
    host: str,
    port: int,
    served_model_name: str | None,
    generation_defaults: Mapping[str, object],
    extra_arguments: Sequence[str] = (),
) -> list[str]:
    """The full command of vLLM's OpenAI server, run with this Python (so in this
    environment): ``vllm serve TARGET ...``, or where the installed distribution is not named
    ``vllm`` (vLLM 0.32.0's CPU build is ``vllm-cpu``, and its ``vllm`` command then fails
    looking up its own version) the server module it wraps, ``--model TARGET ...``."""
    if vllm_command_works():
        command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", spec.target]
    else:
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        command += ["--model", spec.target]
    command += spec.serve_arguments()
    command += ["--host", host, "--port", str(port)]
    if served_model_name:
        command += ["--served-model-name", served_model_name]
    if generation_defaults:
        command += ["--override-generation-config", json.dumps(dict(generation_defaults))]
    return command + list(extra_arguments)


def vllm_command_works() -> bool:
    """Whether ``vllm serve`` can run: vLLM's command reads the version of a distribution
    named ``vllm``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
    except PackageNotFoundError:
        return False
    return True


def printable(command: Sequence[str], *, environment: Mapping[str, str] | None = None) -> str:
    """The command as a user would type it (``vllm serve ...`` or ``python -m ...``),
    preceded by the variables of ``environment`` that differ from this process's."""
    words = list(command)
    if words[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]:
        words = ["vllm", "serve", *words[4:]]
    else:
        words[0] = "python"
    changed = {
        name: value for name, value in (environment or {}).items() if os.environ.get(name) != value
    }
    return shlex.join([*(f"{name}={value}" for name, value in sorted(changed.items())), *words])


def exec_serve(command: Sequence[str]) -> None:
    """Replace this process with vLLM's server (signals then go straight to vLLM)."""
    os.execve(command[0], list(command), engine_environment(os.environ))
