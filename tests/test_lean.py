"""The lean forward: the same logits as transformers' ``model(...)``, across cache crops and
buffer growth; models it cannot run fall back to transformers' forward."""

from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM

from flyspec.bench.forward_cost import time_forwards
from flyspec.config import FORWARD_PATHS, DecodeConfig, FlyConfig, KernelConfig
from flyspec.decoding.loop import SpeculativeDecoder
from flyspec.errors import FlyspecError
from flyspec.models.cache import CachedLM, TransformersForward, make_forward
from flyspec.models.kernels import check_compiled_forward
from flyspec.models.lean import LeanForward, lean_unsupported_reason
from flyspec.testing.host_reads import HostReads
from tests.tiny import make_tiny_model

VOCAB = 64


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(vocab_size=VOCAB, seed=3, dtype=torch.float64)


def full_forward_logits(model, tokens, num_logits):
    """Logits of one cache-free forward over the whole sequence: ``[num_logits, V]``."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -num_logits:]


@pytest.mark.parametrize("compiled", [False, True])
def test_blocks_of_any_size_give_the_logits_of_one_full_forward(model, compiled):
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (300,), generator=generator).tolist()
    lean = LeanForward(model, compiled=compiled)
    graphs_before = counters["stats"]["unique_graphs"]
    start = 0
    with torch.inference_mode():
        # Blocks like a prefill and rounds; compiled, those over 16 tokens run eagerly, and
        # the one of 230 grows the buffers past their first 256 positions.
        for size in (7, 1, 1, 16, 3, 1, 11, 20, 230, 3, 1, 6):
            block = tokens[start : start + size]
            logits = lean.forward(torch.tensor([block]), size)
            start += size
            expected = full_forward_logits(model, tokens[:start], size)
            # Fused by the compiler, the norms' float32 arithmetic rounds differently.
            tolerance = {"atol": 1e-5, "rtol": 1e-5} if compiled else {}
            torch.testing.assert_close(logits, expected, **tolerance)
    assert lean.length == 300 and lean.capacity == 512
    # One graph for a token, one for blocks of every size, whatever the capacity.
    assert counters["stats"]["unique_graphs"] - graphs_before <= (2 if compiled else 0)


def test_padded_blocks_give_the_logits_of_unpadded_ones(model, capsys):
    # Padded to a few sizes (as on CUDA, where each size is a CUDA graph): the padding's keys
    # and values sit past the new tokens and are overwritten before anything attends to them.
    tokens = [(5 * i + 3) % VOCAB for i in range(120)]
    lean = LeanForward(model, compiled=True, pad_sizes=(1, 4, 16, 65))
    start = 0
    with torch.inference_mode():
        for size in (9, 1, 3, 5, 1, 16, 2, 64, 1):
            logits = lean.forward(torch.tensor([tokens[start : start + size]]), size)
            start += size
            expected = full_forward_logits(model, tokens[:start], size)
            torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
            assert lean.length == start
    assert set(lean.compile_checks) == {"token", "block"}
    assert max(lean.compile_checks.values()) < 1e-4
    assert "compiling" in capsys.readouterr().err


def test_a_compiled_forward_that_differs_from_the_eager_one_is_dropped(model, capsys):
    lean = LeanForward(model, compiled=True)
    tokens = [5, 9, 2, 33, 8, 1, 4]

    def wrong(input_ids, positions):  # every logit off by one
        return lean._step(input_ids, positions) + 1.0

    lean._compiled_step = wrong
    with torch.inference_mode():
        logits = lean.forward(torch.tensor([tokens]), 2)
        assert lean.forward_path == "lean" and lean._compiled_step is None
        later = lean.forward(torch.tensor([[7]]), 1)
    torch.testing.assert_close(logits, full_forward_logits(model, tokens, 2))
    torch.testing.assert_close(later, full_forward_logits(model, tokens + [7], 1))
    warning = capsys.readouterr().err.strip().splitlines()[-1]
    assert warning.startswith("warning: ") and "running eagerly" in warning


def test_auto_is_the_lean_forward_off_cuda(model):
    runner = make_forward(model, "auto")
    assert isinstance(runner, LeanForward) and runner.forward_path == "lean"
    assert CachedLM(model).forward_path == "lean"


def test_a_crop_drops_the_rejected_positions(model):
    lean = LeanForward(model)
    with torch.inference_mode():
        lean.forward(torch.tensor([[5, 9, 2, 33, 8, 1, 4]]), 1)
        lean.crop(3)  # keep 5 9 2; a different block follows
        logits = lean.forward(torch.tensor([[60, 61]]), 2)
    torch.testing.assert_close(logits, full_forward_logits(model, [5, 9, 2, 60, 61], 2))
    with pytest.raises(ValueError):
        lean.crop(6)


def test_a_cached_lm_takes_a_runner_as_it_is(model):
    runner = LeanForward(model)
    lm = CachedLM(runner)
    assert lm.runner is runner and lm.forward_path == "lean" and lm.vocab_size == VOCAB
    tokens = [5, 9, 2, 33, 8]
    torch.testing.assert_close(lm.logits(tokens, 2), full_forward_logits(model, tokens, 2))
    assert lm.cached_tokens == tokens and runner.length == len(tokens)


def test_buffers_grow_past_their_first_capacity_and_keep_the_cache(model):
    tokens = [(7 * i) % VOCAB for i in range(300)]
    lean = LeanForward(model)
    with torch.inference_mode():
        lean.forward(torch.tensor([tokens[:250]]), 1)
        first_capacity = lean.capacity
        logits = lean.forward(torch.tensor([tokens[250:]]), 3)
    assert lean.capacity > first_capacity >= 250
    torch.testing.assert_close(logits, full_forward_logits(model, tokens, 3))


def test_every_forward_path_decodes_the_same_tokens(model):
    # Other shapes than the target's: the compiled forward compiles both (and once made the
    # head counts symbols, which attention refused).
    draft = make_tiny_model(vocab_size=VOCAB, seed=4, num_heads=8, dtype=torch.float64)
    config = DecodeConfig(mode="fly", k=5, max_new_tokens=30, fly=FlyConfig(theta=0.0, window=2))
    outputs = {}
    for path in FORWARD_PATHS:
        decoder = SpeculativeDecoder(model, draft, forward_path=path)
        outputs[path] = [event.token for event in decoder.stream([3, 1, 4, 1, 5], config)]
    assert outputs["lean"] == outputs["transformers"] == outputs["compiled"]


def test_the_compiled_forward_refuses_what_it_cannot_compile(model):
    with pytest.raises(FlyspecError, match="--linear default --draft-quant none"):
        check_compiled_forward(KernelConfig(forward="compiled"))
    check_compiled_forward(KernelConfig(forward="lean"))
    check_compiled_forward(replace(KernelConfig.plain(), forward="compiled"))


@pytest.mark.parametrize(
    "error",
    [
        torch._dynamo.exc.Unsupported("an operator it cannot trace"),
        RuntimeError("an inductor failure"),  # not one of dynamo's exception classes
        AssertionError("an assertion inside the compiler"),
    ],
)
def test_any_failure_to_compile_runs_eagerly_with_one_line(model, capsys, error):
    runner = LeanForward(model, compiled=True)

    def fails(*args):
        raise error

    runner._compiled_step = fails
    tokens = [5, 9, 2, 33]
    with torch.inference_mode():
        logits = runner.forward(torch.tensor([tokens]), 2)
        later = runner.forward(torch.tensor([[7]]), 1)
    assert runner.forward_path == "lean" and runner.length == len(tokens) + 1
    torch.testing.assert_close(logits, full_forward_logits(model, tokens, 2))
    torch.testing.assert_close(later, full_forward_logits(model, tokens + [7], 1))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "warning" in line]
    assert len(lines) == 1 and "running eagerly" in lines[0] and str(error) in lines[0]
    assert "Traceback" not in err


def test_models_of_many_shapes_and_dtypes_each_compile_in_one_process():
    # dynamo keeps at most recompile_limit (8) graphs per function, and every model compiles
    # the same one: without a budget of its own, the fifth model of a new shape failed.
    graphs_before = counters["stats"]["unique_graphs"]
    shapes = [(h, dtype) for dtype in (torch.float32, torch.bfloat16) for h in (32, 48, 64, 80)]
    for index, (hidden, dtype) in enumerate(shapes):
        model = make_tiny_model(vocab_size=VOCAB, seed=index, hidden=hidden, dtype=dtype)
        runner = LeanForward(model, compiled=True)
        tokens = [5, 9, 2, 33, 8, 1]
        with torch.inference_mode():
            runner.forward(torch.tensor([tokens[:3]]), 1)
            runner.forward(torch.tensor([tokens[3:4]]), 1)
            logits = runner.forward(torch.tensor([tokens[4:]]), 2)
        assert runner.forward_path == "compiled", f"model {index} ({hidden}, {dtype}) fell back"
        assert set(runner.compile_checks) == {"token", "block"}
        expected = full_forward_logits(model, tokens, 2)
        tolerance = {"atol": 0.1, "rtol": 0.05} if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(logits, expected, **tolerance)
    assert counters["stats"]["unique_graphs"] - graphs_before > 8
    # A graph a model needs later, past its first compiles, still has room: here one traced
    # under a torch function mode (a caller's), compiled again rather than run eagerly.
    with HostReads(), torch.inference_mode():
        runner.forward(torch.tensor([[3]]), 1)
    assert runner.forward_path == "compiled"


def test_other_architectures_fall_back_to_transformers():
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    dynamic_rope = LlamaForCausalLM(config).eval()
    assert "depends on the sequence length" in lean_unsupported_reason(dynamic_rope)
    assert isinstance(make_forward(dynamic_rope, "lean"), TransformersForward)
    assert CachedLM(dynamic_rope).forward_path == "transformers"
    with pytest.raises(FlyspecError, match="compiled forward runs what the lean forward runs"):
        make_forward(dynamic_rope, "compiled")
    with pytest.raises(ValueError, match="cannot run this model"):
        LeanForward(dynamic_rope)


def test_training_mode_and_unknown_paths_are_refused(model):
    model.train()
    try:
        assert lean_unsupported_reason(model) == "the model is in training mode"
    finally:
        model.eval()
    with pytest.raises(ValueError, match="forward path must be one of"):
        make_forward(model, "fast")


def test_a_request_and_a_runner_made_apart_share_the_compiled_graphs(model):
    # A request reserves its cache before its first forward: in inference mode, as every
    # forward runs, or its buffers would be other tensors to the graphs' guards.
    decoder = SpeculativeDecoder(model, forward_path="compiled")
    list(decoder.stream([1, 2, 3], DecodeConfig(mode="target", max_new_tokens=4)))
    graphs_before = counters["stats"]["unique_graphs"]
    runner = LeanForward(model, compiled=True)
    with torch.inference_mode():
        runner.forward(torch.tensor([[1, 2, 3]]), 1)
        runner.forward(torch.tensor([[4]]), 1)
    assert counters["stats"]["unique_graphs"] == graphs_before


def test_every_kind_of_request_runs_on_the_same_two_graphs():
    """A model's compiled forward is one graph for one token and one for blocks, whatever
    feeds it: the context's tail cut from the device's copy, a drafter's step chosen outside
    inference mode, a block, a prompt lookup's block, a prediction's, a row of a wider
    tensor."""
    target = make_tiny_model(vocab_size=VOCAB, seed=5, hidden=56)  # a width no other test compiles
    draft = make_tiny_model(vocab_size=VOCAB, seed=6, hidden=56)
    decoder = SpeculativeDecoder(target, draft, forward_path="compiled")
    graphs_before = counters["stats"]["unique_graphs"]
    for prompt in ([3, 7, 11, 7, 3], [5, 6, 7, 8, 9, 10, 11, 5, 6]):
        for mode, drafter in (("target", "model"), ("spd", "model"), ("fly", "ngram")):
            config = DecodeConfig(mode=mode, drafter=drafter, k=4, max_new_tokens=12)
            list(decoder.stream(prompt, config))
        list(decoder.stream(prompt, DecodeConfig(mode="spd", k=4), prediction=prompt))
    # Another runner, fed rows cut from a wider tensor (as the bench's forward costs are).
    time_forwards(target, new_tokens=(1, 3, 8), forward_paths=("compiled",), context_tokens=10)
    assert counters["stats"]["unique_graphs"] - graphs_before == 2
