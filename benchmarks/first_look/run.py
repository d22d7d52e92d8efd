"""The run: its settings from the command line, the environment it describes, and the phases
in their order (:class:`FirstLook`)."""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

from flyspec.config import DecodeConfig
from flyspec.decoding.loop import SpeculativeDecoder
from flyspec.models.timing import wait_for_device
from flyspec.support.machine import git_commit

from .models import (
    DRAFT,
    MODELS,
    TARGETS,
    build_model,
    load_config,
    model_row,
    random_prompt,
    release_memory,
)
from .phases.attention import attention_row
from .phases.bandwidth import measure_copy_bandwidth
from .phases.compiled import compiled_cost_row, compiled_row
from .phases.compiles import compile_rows
from .phases.engine import engine_row
from .phases.forward_cost import forward_cost_row
from .phases.goals import goal_rows
from .phases.kernel_check import kernel_row
from .phases.loop_overhead import overhead_row
from .phases.profile import profile_row
from .phases.projection import load_tau, projection_rows
from .phases.replay import TRACES, load_replay_traces, replay_rows
from .phases.same_tokens import (
    SameTokensCase,
    compiled_against_eager_row,
    compiled_same_tokens_cases,
    same_tokens_cases,
    same_tokens_row,
)
from .plan import (
    COMPILE_BUDGET_S,
    COMPILED_K,
    FULL,
    OVERHEAD_KS,
    QUICK_ORDER,
    QUICK_REPLAY_REQUESTS,
    QUICK_REPLAYS,
    REPLAYS,
    SAME_TOKENS_K,
    SAME_TOKENS_TARGET,
    TINY,
)
from .runner import PhaseRunner
from .table import PhaseSkipped, Row, describe, write_outputs


def environment(device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> dict:
    """Where and how the figures were made."""
    import transformers

    described = platform.processor() or platform.machine()
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        described = (
            f"{properties.name}, {properties.total_memory / 2**30:.0f} GiB, "
            f"compute capability {properties.major}.{properties.minor}, CUDA {torch.version.cuda}"
        )
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_description": described,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "commit": git_commit(),
        "tiny": args.tiny,
        "shapes": shapes_of(args),
        "cpu_threads": torch.get_num_threads(),
        "targets": args.targets,
    }


class FirstLook:
    """The phases in order: the copy bandwidth, the draft, then each target built, measured
    and let go before the next (the 32B target alone holds about 65 GB), the projections, and
    the kernel check."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("no CUDA device: pass --device cpu (with --rehearse or --tiny)")
        self.dtype = resolve_dtype(args.dtype, self.device, rehearse=args.rehearse)
        if self.device.type == "cpu":
            torch.set_num_threads(args.threads)
        self.shapes = shapes_of(args)
        self.sizes = FULL if self.shapes == "real" else TINY
        self.targets = parse_targets(args.targets)
        if args.quick:
            self.targets.sort(key=QUICK_ORDER.index)
        real = self.shapes == "real"
        if self.device.type == "cpu" and real and {"7b", "32b"} & set(self.targets):
            raise SystemExit(
                "the 7B and 32B shapes need a GPU: pass --rehearse (or --tiny) on the CPU"
            )
        self.env = environment(self.device, self.dtype, args)
        self.folders = output_folders(args)
        self.runner = PhaseRunner(args.time_limit, after_phase=self.save)
        self.ks = sorted(set(OVERHEAD_KS) | {entry["k"] for entry in load_tau()})
        self.bandwidth: float | None = None
        self.draft_ms: float | None = None
        self.eager: dict[tuple[str, str | int], Row] = {}  # rows to compare compiled ones with
        self.draft_compiled = False  # whether a phase has compiled the draft's forward yet

    def run(self) -> tuple[dict, list[Row]]:
        env = self.env
        self.runner.rows.append(
            Row("device", env["device"], "ok", env["device_description"], describe(env), env)
        )
        rows = self.runner.phase(
            "bandwidth",
            "device-to-device copy",
            lambda: measure_copy_bandwidth(self.device, self.sizes),
        )
        self.bandwidth = self.runner.value(rows, "bytes_per_second")
        if not self.args.quick:
            self.check_same_tokens()
            release_memory(self.device)
            self.measure_draft()
            for name in self.targets:
                self.measure_target(name)
                release_memory(self.device)
            self.runner.phase(
                "kernel check",
                "vLLM 0.34 FLy kernel",
                lambda: kernel_row(self.device, self.sizes, self.args.kernel_batches),
            )
        draft = self.build(DRAFT)
        for index, name in enumerate(self.targets):
            self.measure_compiled(name, draft, loop=index == 0)
            release_memory(self.device)
        if self.args.quick:  # after the targets: the largest ones' goals come first
            del draft
            release_memory(self.device)
            self.check_same_tokens()
        self.runner.rows.extend(compile_rows(self.runner.compiles, shapes=self.shapes))
        self.runner.rows.extend(goal_rows(self.runner.rows, on_cuda=self.device.type == "cuda"))
        env["elapsed_s"] = round(time.perf_counter() - self.runner.started, 1)
        env["complete"] = True
        return env, self.runner.rows

    def label(self, name: str, dtype: torch.dtype | None = None) -> str:
        """How the compile rows name model ``name`` in ``dtype`` (default: the run's)."""
        return f"{name} {str(dtype or self.dtype).removeprefix('torch.')}"

    def compile_needs(self, name: str) -> float:
        """The seconds a phase that compiles model ``name`` is given before the time limit
        (:data:`COMPILE_BUDGET_S`; none on the CPU's shapes, which have no time limit)."""
        return COMPILE_BUDGET_S[name] if self.shapes == "real" else 0

    def build(self, name: str, dtype: torch.dtype | None = None) -> torch.nn.Module | None:
        """Model ``name`` on the device, in ``dtype`` (default: the run's), or None (its row
        says why)."""
        built: list[torch.nn.Module] = []
        dtype = dtype or self.dtype

        def work() -> Row:
            started = time.perf_counter()
            config = load_config(name, shapes=self.shapes)
            seed = list(MODELS).index(name)
            built.append(build_model(config, device=self.device, dtype=dtype, seed=seed))
            wait_for_device(self.device)
            return model_row(name, built[0], self.sizes.context, time.perf_counter() - started)

        subject = f"{name} ({MODELS[name]})"
        if dtype != self.dtype:
            subject += f", {str(dtype).removeprefix('torch.')}"
        if self.runner.phase("model", subject, work)[0].status != "ok":
            built.clear()
            release_memory(self.device)
        return built[0] if built else None

    def measured(
        self, model: torch.nn.Module | None, work: Callable[[torch.nn.Module], Row]
    ) -> Callable[[], Row]:
        """``work`` on ``model``, skipped when the model could not be built."""

        def guarded() -> Row:
            if model is None:
                raise PhaseSkipped("the model was not built")
            return work(model)

        return guarded

    def save(self, rows: list[Row]) -> None:
        """Write the rows so far, marked partial until the run has ended."""
        elapsed = round(time.perf_counter() - self.runner.started, 1)
        env = {**self.env, "elapsed_s": elapsed, "complete": False}
        for folder in self.folders:
            write_outputs(folder, env, rows)

    def check_same_tokens(self) -> None:
        """Every drafter and rule on the device, in float32 (where forwards of different
        sizes agree closely enough that exact decoding must give the target's tokens): the
        draft and the :data:`SAME_TOKENS_TARGET` target, a prompt that repeats itself (so that
        n-gram drafting and MLA find matches), each case of :func:`same_tokens_cases` against
        the target alone."""
        draft = self.build(DRAFT, dtype=torch.float32)
        target = self.build(SAME_TOKENS_TARGET, dtype=torch.float32)
        reference: list[int] = []
        prompt = [] if target is None else random_prompt(target.config.vocab_size, 16) * 4

        compiled: list[int] = []

        def greedy() -> Row:
            if draft is None or target is None:
                raise PhaseSkipped("the models were not built")
            decoder = SpeculativeDecoder(target, forward_path="lean")
            config = DecodeConfig(mode="target", max_new_tokens=self.sizes.same_tokens)
            reference.extend(event.token for event in decoder.stream(prompt, config))
            result = f"{len(reference)} tokens after a prompt of {len(prompt)}"
            return Row("same tokens", "the target alone, greedy", "ok", result)

        def case_row(case: SameTokensCase, tokens: list[int]) -> Callable[[], Row]:
            def work() -> Row:
                if not tokens:
                    raise PhaseSkipped("no answer of the target alone to compare with")
                return same_tokens_row(case, target, draft, prompt, tokens)

            return work

        def against_eager() -> Row:
            if not reference:
                raise PhaseSkipped("no answer of the eager target alone to compare with")
            return compiled_against_eager_row(target, prompt, reference, compiled)

        self.runner.phase("same tokens", "the target alone, greedy", greedy)
        cases = same_tokens_cases(SAME_TOKENS_K)
        for case in cases if not self.args.quick else [c for c in cases if c.lossless]:
            self.runner.phase("same tokens", case.subject, case_row(case, reference))
        float32 = torch.float32
        self.runner.phase(
            "same tokens",
            "the target alone, compiled, against eager",
            against_eager,
            needs=self.compile_needs(SAME_TOKENS_TARGET),
            compiles=self.label(SAME_TOKENS_TARGET, float32),
        )
        for case in compiled_same_tokens_cases(SAME_TOKENS_K):
            self.runner.phase(
                "same tokens",
                case.subject,
                case_row(case, compiled),
                needs=self.compile_needs(DRAFT) if case.draft == "draft" else 0,
                compiles=self.label(DRAFT, float32) if case.draft == "draft" else None,
            )

    def measure_compiled(self, name: str, draft: torch.nn.Module | None, *, loop: bool) -> None:
        """The target ``name`` on the compiled forward: alone (against the eager row of the
        run, where there is one), its ``V(n)`` up to 65 tokens, with ``loop`` drafting for
        itself at K=:data:`COMPILED_K` (the loop's own time and host synchronisations per
        round), and the traces of :data:`REPLAYS` replayed with ``draft`` drafting. Last, as
        compiling takes the longest."""
        model = self.build(name)
        sizes, bandwidth, device = self.sizes, self.bandwidth, self.device
        label = self.label(name)
        replayed = bool((QUICK_REPLAYS if self.args.quick else REPLAYS).get(name))
        draft_first = replayed and not self.draft_compiled  # its replays compile the draft
        self.draft_compiled = self.draft_compiled or replayed

        def alone(m: torch.nn.Module) -> Row:
            return compiled_row(
                lambda: engine_row(
                    name, m, sizes, bandwidth, role="target", forward_path="compiled"
                ),
                self.eager.get((name, "engine")),
                "ms_per_token",
                device=device,
            )

        def drafting(m: torch.nn.Module) -> Row:
            return compiled_row(
                lambda: overhead_row(name, m, sizes, COMPILED_K, forward_path="compiled"),
                self.eager.get((name, COMPILED_K)),
                "round_ms",
                device=device,
            )

        def replays(m: torch.nn.Module) -> list[Row]:
            if draft is None:
                raise PhaseSkipped("the draft was not built")
            traces = load_replay_traces()
            plan = (QUICK_REPLAYS if self.args.quick else REPLAYS).get(name, ())
            missing = [f"{s}/{t}" for s, t in plan if (s, t) not in traces]
            if missing:
                raise RuntimeError(f"no trace {', '.join(missing)} in {TRACES}")
            requests = sizes.replay_requests
            if self.args.quick and self.shapes == "real":
                requests = QUICK_REPLAY_REQUESTS
            wanted = [(s, traces[s, t]) for s, t in plan]
            return replay_rows(name, m, draft, wanted, requests=requests)

        self.runner.phase(
            "attention",
            f"target {name}: SDPA at the compiled shapes",
            self.measured(model, lambda m: attention_row(name, m, sizes)),
        )
        compiled = [  # (subject, work, the compile budget it needs)
            (f"target {name}, mode target", alone, self.compile_needs(name)),
            (f"target {name}: V(n), compiled", lambda m: compiled_cost_row(name, m, sizes), 0),
        ]
        if loop:
            compiled.append((f"target {name} drafting for itself, FLy K={COMPILED_K}", drafting, 0))
        for subject, work, needs in compiled:
            self.runner.phase(
                "compiled", subject, self.measured(model, work), needs=needs, compiles=label
            )
        if replayed:
            self.runner.phase(
                "replay",
                f"traces on the {name} target",
                self.measured(model, replays),
                needs=self.compile_needs(DRAFT) if draft_first else 0,
                compiles=self.label(DRAFT) if draft_first else label,
            )

    def measure_eager(
        self, name: str, model: torch.nn.Module | None, *, role: str
    ) -> tuple[dict[int, float] | None, list[Row]]:
        """Model ``name`` (``role``: the draft or a target) eager: its forward cost (``d``, or
        ``V(n)``), then alone through the decoder. ``-> (its costs in ms by new tokens, None
        where not measured; the engine's rows)``."""
        draft = role == "draft"
        rows = self.runner.phase(
            "forward cost",
            f"{role} {name}: {'d' if draft else 'V(n)'}",
            self.measured(model, lambda m: forward_cost_row(name, m, self.sizes, draft=draft)),
        )
        engine = self.runner.phase(
            "engine alone",
            f"{role} {name}",
            self.measured(
                model, lambda m: engine_row(name, m, self.sizes, self.bandwidth, role=role)
            ),
        )
        return self.runner.value(rows, "median_ms"), engine

    def measure_draft(self) -> None:
        costs, _ = self.measure_eager(DRAFT, self.build(DRAFT), role="draft")
        self.draft_ms = None if costs is None else costs[1]

    def measure_target(self, name: str) -> None:
        model = self.build(name)
        costs, rows = self.measure_eager(name, model, role="target")
        engine_ms = self.runner.value(rows, "ms_per_token")
        self.eager[name, "engine"] = rows[0]
        if name == self.targets[0]:
            self.runner.phase(
                "profile",
                f"target {name}, eager",
                self.measured(model, lambda m: profile_row(name, m, self.sizes)),
            )
        overhead_ms = {}
        for k in self.ks:
            rows = self.runner.phase(
                "loop overhead",
                f"target {name} drafting for itself, FLy K={k}",
                self.measured(model, lambda m, k=k: overhead_row(name, m, self.sizes, k)),
            )
            self.eager[name, k] = rows[0]
            if (value := self.runner.value(rows, "overhead_ms_per_round")) is not None:
                overhead_ms[k] = value

        def project() -> list[Row]:
            if costs is None or self.draft_ms is None:
                raise PhaseSkipped("forward costs missing")
            return projection_rows(
                name, costs, self.draft_ms, engine_ms=engine_ms, overhead_ms=overhead_ms
            )

        self.runner.phase("projection", f"the {name} target", project)


def shapes_of(args: argparse.Namespace) -> str:
    """The models' shapes (:data:`SHAPES`) the arguments ask for."""
    return "tiny" if args.tiny else "rehearsal" if args.rehearse else "real"


def resolve_dtype(name: str, device: torch.device, *, rehearse: bool = False) -> torch.dtype:
    """``auto``: bfloat16 on a GPU and in the rehearsal of one, float32 on the CPU otherwise
    (where bfloat16 is slow)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or rehearse else torch.float32
    return getattr(torch, name)


def parse_targets(text: str) -> list[str]:
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise SystemExit(f"--targets takes some of {','.join(TARGETS)}, got {text!r}")
    return names


def output_folders(args: argparse.Namespace) -> list[Path]:
    """Where the table is written: ``$OUT`` when set, and ``--output``."""
    folders = [Path(os.environ["OUT"])] if os.environ.get("OUT") else []
    return folders + ([args.output] if args.output else [])
