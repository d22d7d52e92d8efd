"""The decoder's output under a fixed set of configurations, pinned to ``DECODER_REVISION``.

Caches of generated text key on the revision (``flyspec.evaluation.cache``), so a change that
alters what the decoder emits must bump it. This test fails on such a change until the
revision is bumped and its digest recorded below. Float64 tiny models keep argmax and the
entropy gate far from ties, so the digest is the same on every CPU.
"""

from __future__ import annotations

import copy
import hashlib
import json

import pytest
import torch

from flyspec.config import DecodeConfig, FlyConfig, SamplingConfig
from flyspec.decoding.loop import DECODER_REVISION, SpeculativeDecoder
from tests.tiny import make_tiny_model

VOCAB = 48
END = VOCAB - 1
PROMPT = [5, 9, 5, 9, 12, 5, 9]

DIGESTS = {
    1: "62da696b8f75417a8fd153cf443f919ff8e5b493370663fa6fb022ef06f62684",
    2: "62da696b8f75417a8fd153cf443f919ff8e5b493370663fa6fb022ef06f62684",
    3: "62da696b8f75417a8fd153cf443f919ff8e5b493370663fa6fb022ef06f62684",
    4: "62da696b8f75417a8fd153cf443f919ff8e5b493370663fa6fb022ef06f62684",
}
"""The digest of :func:`emitted` at each revision; a new revision adds its own line. Revision
2 (FLy's gate reads the logits after temperature and top-k/top-p at T > 0) emits the same
tokens for these configurations: tests/test_decode.py pins a case it changes. Revision 3
(-k auto learns acceptance as committed and counts loose keeps where a window could fit, so it
may choose other blocks, which changes what FLy loosens) changes none of them: none uses
-k auto, whose choices follow measured times (tests/test_auto_k.py pins its rules). Revision 4
(the draft model reads its block once, so it drafts past an end token before the block is cut
there) changes none of them: a sampled draft then draws more from its generator, which moves
later samples only where the target rejects a block before its end token
(tests/test_decode.py pins such a case)."""

PAPER = FlyConfig(window=2, theta=0.3)
CONFIGS = {
    "target": DecodeConfig(mode="target", max_new_tokens=40),
    "spd": DecodeConfig(mode="spd", k=5, max_new_tokens=40),
    "fly": DecodeConfig(mode="fly", k=5, max_new_tokens=40, fly=PAPER),
    "fly near the budget": DecodeConfig(mode="fly", k=5, max_new_tokens=13, fly=PAPER),
    "floor and deferral": DecodeConfig(
        mode="fly",
        k=5,
        max_new_tokens=40,
        fly=FlyConfig(window=2, theta=0.3, min_ratio=0.1, defer=True),
    ),
    "ngram": DecodeConfig(
        mode="fly", drafter="ngram", k=5, max_new_tokens=40, fly=FlyConfig(window=1, theta=0.3)
    ),
    "mla": DecodeConfig(mode="fly", drafter="mla", k=5, max_new_tokens=40, fly=PAPER),
    "sampled": DecodeConfig(
        mode="fly",
        k=5,
        max_new_tokens=40,
        fly=PAPER,
        sampling=SamplingConfig(temperature=0.8, top_k=20, seed=7),
        draft_temperature=0.8,
    ),
}


@pytest.fixture(scope="module")
def emitted() -> dict[str, list[tuple[int, str]]]:
    """Each configuration's ``(token, origin)`` pairs from a target and a draft that is the
    target with its weights perturbed slightly (so that it agrees often, not always)."""
    target = make_tiny_model(vocab_size=VOCAB, seed=3, dtype=torch.float64)
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in draft.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            parameter.add_(noise * 0.015)
    decoder = SpeculativeDecoder(target, draft, eos_token_ids=[END])
    return {
        name: [(event.token, event.origin) for event in decoder.stream(PROMPT, config)]
        for name, config in CONFIGS.items()
    }


def test_the_configurations_exercise_every_origin(emitted):
    origins = {origin for pairs in emitted.values() for _, origin in pairs}
    assert origins == {"exact", "loose", "correction", "bonus"}
    assert len(emitted["fly near the budget"]) == 13
    assert any(origin == "loose" for _, origin in emitted["floor and deferral"])


def test_the_decoders_output_is_pinned_to_its_revision(emitted):
    text = json.dumps(emitted, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()
    assert DIGESTS.get(DECODER_REVISION) == digest, (
        "the decoder emits other tokens than at revision "
        f"{DECODER_REVISION}: bump DECODER_REVISION in flyspec/decoding/loop.py and record "
        f"{DECODER_REVISION + 1}: {digest!r} in DIGESTS"
    )
