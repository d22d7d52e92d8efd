"""What a round costs the host in synchronisations, for every kind of round: reads of device
values into Python, and tensors made from Python values (on CUDA, copies from the host that
wait unless pinned), counted with a torch function mode over whole greedy requests on tiny
random-weight models on the CPU (the counts, not timings: they are what a GPU would pay).

    python benchmarks/host_reads.py            # a table: per round, and per request

A draft model near the target (its weights moved by 10% of their spread) makes FLy keep
tokens loosely, and defer some mismatches (confirmed and rolled back); the prediction is the
target's own answer with three tokens inserted. The first request of each row warms the
forwards up; the second is counted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from flyspec.config import DecodeConfig, FlyConfig  # noqa: E402
from flyspec.decoding.loop import SpeculativeDecoder  # noqa: E402
from flyspec.decoding.stats import RequestStats  # noqa: E402
from flyspec.support.machine import git_commit  # noqa: E402
from tests.tiny import make_tiny_model, near_copy  # noqa: E402

try:
    from flyspec.testing.host_reads import HostReads
except ImportError:  # a tree from before the counter moved into the package
    from tests.host_reads import HostReads

VOCAB = 64
PROMPT = [5]
NEW_TOKENS = 40
KINDS = {
    "target alone": (DecodeConfig(mode="target"), False),
    "exact, draft model": (DecodeConfig(mode="spd", k=6), False),
    "FLy, loose tokens": (DecodeConfig(mode="fly", k=6, fly=FlyConfig(theta=0.0, window=1)), False),
    "FLy, deferred windows": (
        DecodeConfig(mode="fly", k=6, fly=FlyConfig(theta=0.0, window=2, defer=True)),
        False,
    ),
    "prediction": (DecodeConfig(mode="spd", k=6), True),
    "prompt lookup": (DecodeConfig(mode="spd", k=6, drafter="ngram"), False),
    "MLA": (DecodeConfig(mode="spd", k=6, drafter="mla"), False),
}


def main() -> None:
    target = make_tiny_model(vocab_size=VOCAB, seed=1, dtype=torch.float64)
    draft = near_copy(target, 0.1)
    plain = DecodeConfig(mode="target", max_new_tokens=NEW_TOKENS)
    answer = [e.token for e in SpeculativeDecoder(target).stream(PROMPT, plain)]
    prediction = answer[:12] + [9, 9, 9] + answer[12:]
    print(f"commit {git_commit()}; tiny float64 models, {NEW_TOKENS} new tokens, greedy\n")
    print("| round | rounds | reads a round | host tensors a round | host tensors a request |")
    print("|---|---:|---:|---:|---:|")
    for name, (config, predicted) in KINDS.items():
        config = config.with_updates(max_new_tokens=NEW_TOKENS)
        decoder = SpeculativeDecoder(target, draft)
        given = prediction if predicted else None
        list(decoder.stream(PROMPT, config, prediction=given))
        stats = RequestStats()
        with HostReads() as reads:
            list(decoder.stream(PROMPT, config, stats=stats, prediction=given))
        rounds = stats.num_rounds
        print(
            f"| {name} | {rounds} | {reads.count / rounds:.2f} | "
            f"{reads.from_host / rounds:.2f} | {reads.from_host} |"
        )


if __name__ == "__main__":
    main()
