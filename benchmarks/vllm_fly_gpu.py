"""vLLM 0.34's built-in FLy kernel against flyspec's rule, on a machine without vLLM.

The kernel (``rejection_sample`` in ``vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py``)
and the few vLLM files it imports are Apache-2.0 vLLM code, never committed here: extract
them from the vLLM 0.34.0 wheel into a small folder first, then carry that folder with the run::

    python benchmarks/vllm_fly_gpu.py --extract vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl
    python benchmarks/vllm_fly_gpu.py                       # a CUDA GPU: V = 151936
    TRITON_INTERPRET=1 python benchmarks/vllm_fly_gpu.py --device cpu --vocab-size 64 \\
        --batches 20                                        # CPU, under Triton's interpreter

The extracted files load under a stand-in ``vllm`` package (tiny stubs for what else they
import), which takes precedence over any installed vLLM. The script runs random conformance
batches (:mod:`flyspec.testing.conformance`: greedy, sampled and mixed) through the
kernel, compares its emitted tokens with flyspec's decisions, prints a summary and exits 1 on
any mismatch. Needs torch and triton; flyspec from this working tree (``src`` is put on the
path).
"""

from __future__ import annotations

import argparse
import sys
import time
import zipfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_KERNELS = Path(__file__).resolve().parent / "vllm_fly_kernels"
VLLM_VERSION = "0.34.0"

# The kernel and what it imports, as paths inside the wheel.
KERNEL_FILES = (
    "vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py",
    "vllm/v1/worker/gpu/spec_decode/fly.py",
    "vllm/v1/worker/gpu/spec_decode/draft_logits.py",
    "vllm/v1/worker/gpu/sample/gumbel.py",
    "vllm/v1/worker/gpu/sample/watermark.py",
    "vllm/v1/watermarking/prfs/philox.py",
    "vllm/v1/watermarking/prfs/base.py",
)

# Stand-ins for the rest of vLLM those files import (none of it runs on this path).
STUBS = {
    "vllm/triton_utils/__init__.py": (
        "import triton\n"
        "import triton.language as tl\n"
        "import triton.language.extra.libdevice as tldevice\n\n"
        "HAS_TRITON = True\n"
    ),
    "vllm/distributed/parallel_state.py": (
        "def get_tp_group():\n"
        "    raise NotImplementedError('no tensor parallelism in the stand-in vllm')\n"
    ),
    "vllm/utils/math_utils.py": "def cdiv(a: int, b: int) -> int:\n    return -(a // -b)\n",
    "vllm/v1/worker/gpu/input_batch.py": "class InputBatch:\n    pass\n",
    "vllm/v1/worker/gpu/sample/batch_shard.py": (
        "def _unsupported(*args, **kwargs):\n"
        "    raise NotImplementedError('no sharded draft logits in the stand-in vllm')\n\n\n"
        "shard_owner = shard_owners = shard_row = shard_rows = _unsupported\n"
    ),
}
MARKER = "STAND_IN = True  # flyspec's stand-in vllm package (benchmarks/vllm_fly_gpu.py)\n"


def extract(wheel: Path, target: Path) -> None:
    """Write the kernel files from ``wheel`` and the stand-in package into ``target``."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        version_files = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = archive.read(version_files[0]).decode() if version_files else ""
        if f"\nVersion: {VLLM_VERSION}\n" not in metadata:
            raise SystemExit(f"{wheel} is not vLLM {VLLM_VERSION}")
        for name in KERNEL_FILES:
            if name not in names:
                raise SystemExit(f"{wheel} has no {name}")
            path = target / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(archive.read(name))
    for name, text in STUBS.items():
        path = target / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in sorted({p.parent for p in target.glob("vllm/**/*.py")} | {target / "vllm"}):
        init = folder / "__init__.py"
        if not init.exists():
            init.write_text("")
    (target / "vllm" / "__init__.py").write_text(MARKER)
    size = sum(p.stat().st_size for p in target.rglob("*.py"))
    print(f"extracted {len(KERNEL_FILES)} vLLM files and the stand-in into {target} ({size} B)")


def load_kernel(kernels: Path):
    """vLLM's ``rejection_sample`` from the stand-in package in ``kernels``."""
    if "vllm" in sys.modules:
        raise SystemExit("vllm is already imported: the stand-in must be imported first")
    if not (kernels / "vllm" / "__init__.py").exists():
        raise SystemExit(f"no extracted kernels in {kernels}: run with --extract WHEEL first")
    sys.path.insert(0, str(kernels))
    import vllm

    if not getattr(vllm, "STAND_IN", False):
        raise SystemExit(f"imported {vllm.__file__} instead of the stand-in")
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample

    return rejection_sample


def run(args: argparse.Namespace) -> int:
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    from flyspec.testing import conformance

    rejection_sample = load_kernel(args.kernels)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu (with TRITON_INTERPRET=1)")
    modes = ("greedy", "sampled", "mixed")
    covered: Counter = Counter()
    failures = []
    start = time.perf_counter()
    for seed in range(args.batches):
        batch = conformance.random_batch(
            torch.Generator().manual_seed(args.seed + seed),
            mode=modes[seed % 3],
            vocab_size=args.vocab_size,
            max_drafted=args.max_drafted,
            num_requests=args.requests,
        )
        decisions = conformance.expected_decisions(batch)
        covered += conformance.coverage(batch, decisions)
        inputs = conformance.vllm_rejection_inputs(batch, seed=args.seed + seed, device=device)
        emitted = conformance.vllm_emitted(*rejection_sample(**inputs))
        for mismatch in conformance.compare(batch, decisions, emitted):
            failures.append(f"batch {args.seed + seed}, {mismatch}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    print(
        f"vLLM {VLLM_VERSION} rejection_sample (FLy) vs flyspec.decoding.verify on {device}: "
        f"{args.batches} batches, V={args.vocab_size}, {covered['greedy']} greedy and "
        f"{covered['sampled']} sampled requests, {covered['loose']} loose keeps, "
        f"{elapsed:.1f} s"
    )
    print("cases: " + ", ".join(f"{k}={v}" for k, v in sorted(covered.items())))
    for failure in failures[:20]:
        print("MISMATCH", failure)
    print(f"{len(failures)} mismatching requests")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extract", type=Path, metavar="WHEEL", help="extract, then exit")
    parser.add_argument("--kernels", type=Path, default=DEFAULT_KERNELS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument("--requests", type=int, default=None, help="per batch (default 1-5)")
    parser.add_argument("--max-drafted", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.extract:
        extract(args.extract, args.kernels)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
