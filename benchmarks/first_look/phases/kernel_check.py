"""``kernel check``: vLLM 0.34's FLy kernel against flyspec's rule on random conformance
batches (``benchmarks/vllm_fly_gpu.py``), when its files were extracted into
``benchmarks/vllm_fly_kernels``."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from pathlib import Path

import torch

from .. import BENCHMARKS, load_script
from ..plan import Sizes
from ..table import Row, log

KERNELS = BENCHMARKS / "vllm_fly_kernels"


def kernel_row(
    device: torch.device, sizes: Sizes, batches: int | None, *, kernels: Path = KERNELS
) -> Row:
    """vLLM 0.34's FLy kernel on random conformance batches (benchmarks/vllm_fly_gpu.py), from
    the files extracted into ``kernels``."""
    subject = "vLLM 0.34 rejection_sample (FLy) against flyspec's rule"
    if not (kernels / "vllm" / "__init__.py").exists():
        return Row("kernel check", subject, "skipped", "kernels not extracted")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return Row("kernel check", subject, "skipped", "on the CPU it needs TRITON_INTERPRET=1")
    script = load_script("vllm_fly_gpu")
    args = argparse.Namespace(
        kernels=kernels,
        device=str(device),
        batches=batches or sizes.kernel_batches,
        vocab_size=sizes.kernel_vocab,
        requests=None,
        max_drafted=8,
        seed=0,
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            code = script.run(args)
        except SystemExit as stop:  # its refusals (no kernels, vllm imported first) exit
            raise RuntimeError(str(stop.code)) from None
    lines = printed.getvalue().strip().splitlines()
    for line in lines:
        log(f"kernel check: {line}")
    summary = next((line for line in lines if line.startswith("vLLM")), "")
    mismatches = lines[-1] if lines else "no output"
    return Row(
        "kernel check",
        subject,
        "ok" if code == 0 else "failed",
        mismatches,
        summary,
        {"exit_code": code, "output": lines[-22:]},
    )
