"""Structured outputs: the grammar's masks on synthetic logits, and decoding under a JSON schema
on tiny random-weight models: exact decoding gives the masked target's greedy tokens for every
drafter, no method emits a token the grammar forbids (FLy's loosened acceptance included),
blocks are cut where they break the grammar, and sampled speculative decoding draws from the
masked distribution."""

import json
import math

import llguidance
import pytest
import torch

from flyspec.config import DecodeConfig, FlyConfig, SamplingConfig
from flyspec.decoding.drafters import Draft
from flyspec.decoding.grammar import (
    GrammarTokenizer,
    RequestGrammar,
    allowed_tokens,
    json_schema_grammar,
    masked_logits,
    unpacked_on,
)
from flyspec.decoding.loop import SpeculativeDecoder
from flyspec.decoding.stats import RequestStats
from flyspec.decoding.verify import sampling_probs, verify_greedy, verify_sampling
from flyspec.errors import FlyspecError
from flyspec.models.cache import DeviceTokens
from tests.conftest import DECODE_VOCAB
from tests.sampling import binned_distance, token_histogram
from tests.tiny import make_tiny_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
PROMPT_TEXT = "def f"


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer(DECODE_VOCAB)


@pytest.fixture(scope="module")
def grammar_tokenizer(tokenizer):
    return GrammarTokenizer(
        tokenizer, vocab_size=DECODE_VOCAB, eos_token_ids=[tokenizer.eos_token_id]
    )


@pytest.fixture(scope="module")
def grammar(grammar_tokenizer):
    return json_schema_grammar(SCHEMA, grammar_tokenizer)


def fresh_matcher(grammar):
    return llguidance.LLMatcher(grammar.tokenizer.engine_tokenizer, grammar.source, log_level=0)


def allowed_after(grammar, tokens: list[int]) -> torch.Tensor:
    """``bool[V]``: what a fresh matcher allows after ``tokens`` (the reference)."""
    matcher = fresh_matcher(grammar)
    assert matcher.consume_tokens(tokens)
    bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
    allowed = torch.zeros(DECODE_VOCAB, dtype=torch.bool)
    allowed[: bias.shape[0]] = bias[:DECODE_VOCAB] > 0
    return allowed


def masked_greedy(target, grammar, prompt: list[int], steps: int, eos: int) -> list[int]:
    """The target's greedy tokens under the grammar, from full forwards (no cache)."""
    answer: list[int] = []
    with torch.inference_mode():
        for _ in range(steps):
            logits = target(input_ids=torch.tensor([prompt + answer])).logits[0, -1]
            token = int(logits.masked_fill(~allowed_after(grammar, answer), -math.inf).argmax())
            if token == eos:
                break
            answer.append(token)
    return answer


def test_the_engines_bit_masks_unpack_to_one_flag_a_token():
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 | (1 << 5)
    bitmask[0, 1] = -(2**31)  # bit 31 of the second word: token 63
    bitmask[1, 1] = 1  # token 32
    allowed = allowed_tokens(bitmask, 70)  # wider than the mask: the rest not allowed
    assert allowed.shape == (2, 70)
    assert allowed[0].nonzero().flatten().tolist() == [0, 5, 63]
    assert allowed[1].nonzero().flatten().tolist() == [32]
    # As a GPU unpacks them: the same flags.
    assert torch.equal(unpacked_on(bitmask, 70, device=torch.device("cpu")), allowed)
    assert torch.equal(unpacked_on(bitmask, 40, device=torch.device("cpu")), allowed[:, :40])
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        logits = torch.zeros(2, 66, dtype=dtype)
        masked = masked_logits(logits, bitmask)
        assert masked.dtype == dtype
        assert torch.isinf(masked[0]).sum() == 66 - 3
        assert masked[1, 32] == 0 and torch.isinf(masked[1, :32]).all()


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "frob"}, "frob"),
        ({"type": "string", "pattern": "(unclosed"}, "unclosed"),
        ({"properties": {"a": {"$ref": "#/$defs/nowhere"}}}, "nowhere"),
        ({"type": "string", "format": "weird"}, "weird"),
        (["not", "an", "object"], "list"),
    ],
)
def test_a_schema_the_engine_cannot_use_is_refused_naming_the_problem(
    grammar_tokenizer, schema, named
):
    with pytest.raises(FlyspecError, match=named):
        json_schema_grammar(schema, grammar_tokenizer)


def test_the_matcher_follows_the_context_back_and_forth(grammar, tokenizer):
    prompt = tokenizer.encode(PROMPT_TEXT)
    answer = tokenizer.encode('{"a": 12, "b": "yy"}')
    tokens = DeviceTokens(prompt, device=torch.device("cpu"))
    request = RequestGrammar(grammar, tokens=tokens, prompt_length=len(prompt))
    for length in (3, 7, 2, 9, 0, len(answer)):  # forward, back, forward again
        tokens.truncate(len(prompt))
        tokens.extend(answer[:length])
        block = answer[length : length + 3]
        masks = request.allowed(block)
        for row in range(len(block) + 1):
            expected = allowed_after(grammar, answer[: length + row])
            assert torch.equal(masks[row], expected), (length, row)
        # Tokens drafted since the context count as if they were in it.
        assert torch.equal(
            request.allowed(after=block)[0], allowed_after(grammar, answer[: length + len(block)])
        )


def test_a_block_is_cut_before_its_first_forbidden_token(grammar, tokenizer):
    prompt = tokenizer.encode(PROMPT_TEXT)
    tokens = DeviceTokens(prompt + tokenizer.encode('{"a": 1'), device=torch.device("cpu"))
    request = RequestGrammar(grammar, tokens=tokens, prompt_length=len(prompt))
    block = tokenizer.encode('2, "c": 3')  # "c" is no property of the schema
    draft = Draft(tokens=torch.tensor(block), ids=tuple(block))
    cut = request.cut(draft)
    assert cut.token_ids == tokenizer.encode('2, "')
    assert request.cut(cut) is cut  # a block the grammar allows is left as it is
    # An unread block is read, then cut; its drafter hears of every token it fed.
    heard = []
    unread = Draft(tokens=torch.tensor(block), unread=True, settle=heard.append)
    assert request.cut(unread).token_ids == cut.token_ids
    assert heard == [block]


def test_rows_after_a_forbidden_block_token_allow_everything(grammar, tokenizer):
    """Verification cuts the block at the forbidden token and never reads the rows after it;
    they must not be all -inf (a softmax of them would be NaN)."""
    prompt = tokenizer.encode(PROMPT_TEXT)
    tokens = DeviceTokens(prompt, device=torch.device("cpu"))
    request = RequestGrammar(grammar, tokens=tokens, prompt_length=len(prompt))
    block = tokenizer.encode("x{")  # the answer must start with "{"
    masks = request.allowed(block)
    assert not masks[0, block[0]]
    assert masks[1:].all()
    # The matcher goes on as before.
    assert torch.equal(request.allowed()[0], allowed_after(grammar, []))
    tokens.extend(tokenizer.encode('{"a'))
    assert torch.equal(request.allowed()[0], allowed_after(grammar, tokenizer.encode('{"a')))


def draft_with(tokens: list[int]) -> Draft:
    return Draft(tokens=torch.tensor(tokens), ids=tuple(tokens))


def test_fly_never_keeps_a_draft_token_the_grammar_forbids():
    """Synthetic logits where the gate would keep the mismatched draft token (a flat target:
    high entropy; no window): masked by the grammar, it is refused, greedy and sampled."""
    vocabulary = 8
    logits = torch.zeros(3, vocabulary)
    logits[:, 1] = 0.2  # the target's own choice everywhere: token 1
    draft_tokens = torch.tensor([4, 1])
    loosest = FlyConfig(theta=0.0, window=0)
    kept = verify_greedy(draft_tokens, logits, fly=loosest)
    assert kept.num_kept == 2 and kept.loose_positions == (0,)  # unmasked: kept loosely
    bitmask = torch.full((3, 1), -1, dtype=torch.int32)
    bitmask[0, 0] = ~(1 << 4)  # the grammar forbids token 4 first
    masked = masked_logits(logits, bitmask)
    verdict = verify_greedy(draft_tokens, masked, fly=loosest)
    assert verdict.num_kept == 0 and verdict.next_token == 1
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        sampled = verify_sampling(
            draft_tokens,
            None,
            masked.softmax(dim=-1),
            fly=loosest,
            target_logits=masked,
            generator=generator,
        )
        assert sampled.num_kept == 0 and sampled.next_token != 4


DRAFTERS = ["target", "model", "ngram", "mla", "prediction"]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_exact_decoding_gives_the_masked_targets_greedy_tokens(
    target, draft, grammar, tokenizer, drafter
):
    eos = tokenizer.eos_token_id
    prompt = tokenizer.encode(PROMPT_TEXT)
    reference = masked_greedy(target, grammar, prompt, 40, eos)
    decoder = SpeculativeDecoder(target, draft, eos_token_ids=[eos])
    mode = "target" if drafter == "target" else "spd"
    config = DecodeConfig(
        mode=mode,
        drafter="ngram" if drafter in ("ngram", "prediction") else "model",
        k=4,
        max_new_tokens=40,
    )
    if drafter == "mla":
        config = DecodeConfig(mode="spd", drafter="mla", k=4, max_new_tokens=40)
    prediction = None
    if drafter == "prediction":  # the answer with tokens the grammar forbids in it
        prediction = reference[:6] + tokenizer.encode("zz!") + reference[6:]
    stats = RequestStats()
    events = decoder.stream(prompt, config, grammar=grammar, stats=stats, prediction=prediction)
    assert [event.token for event in events] == reference
    if drafter == "prediction":
        assert "prediction" in {r.source for r in stats.rounds}


def answer_is_allowed(grammar, tokens: list[int]) -> bool:
    return fresh_matcher(grammar).validate_tokens(tokens) == len(tokens)


FLY_CONFIGS = {
    "fly": DecodeConfig(mode="fly", k=4, max_new_tokens=60, fly=FlyConfig(theta=0.0, window=1)),
    "fly, deferred": DecodeConfig(
        mode="fly", k=4, max_new_tokens=60, fly=FlyConfig(theta=0.0, window=2, defer=True)
    ),
    "fly, ngram": DecodeConfig(
        mode="fly", drafter="ngram", k=4, max_new_tokens=60, fly=FlyConfig(theta=0.0, window=0)
    ),
    "fly, sampled": DecodeConfig(
        mode="fly",
        k=4,
        max_new_tokens=60,
        draft_temperature=1.0,
        fly=FlyConfig(theta=0.0, window=0),
        sampling=SamplingConfig(temperature=1.0, seed=5),
    ),
    "spd, sampled": DecodeConfig(
        mode="spd",
        k=4,
        max_new_tokens=60,
        draft_temperature=1.0,
        sampling=SamplingConfig(temperature=0.7, seed=1),
    ),
}


@pytest.mark.parametrize("name", FLY_CONFIGS)
def test_no_method_emits_a_token_the_grammar_forbids(target, draft, grammar, tokenizer, name):
    eos = tokenizer.eos_token_id
    prompt = tokenizer.encode(PROMPT_TEXT)
    decoder = SpeculativeDecoder(target, draft, eos_token_ids=[eos])
    for seed in range(4):
        config = FLY_CONFIGS[name]
        if config.sampling.temperature > 0:
            sampling = SamplingConfig(temperature=config.sampling.temperature, seed=seed)
            config = DecodeConfig(**{**config.__dict__, "sampling": sampling})
        stats = RequestStats()
        tokens = [e.token for e in decoder.stream(prompt, config, grammar=grammar, stats=stats)]
        assert answer_is_allowed(grammar, tokens), tokenizer.decode(tokens)
        if stats.finish_reason == "stop":  # ended by an end token: a whole answer
            value = json.loads(tokenizer.decode(tokens))
            assert set(value) == {"a", "b"} and value["b"] in ("x", "yy")
            assert isinstance(value["a"], int)


def test_loosely_kept_tokens_under_a_grammar_are_all_allowed(target, draft, grammar, tokenizer):
    """FLy at its loosest keeps some draft tokens loosely under the grammar, each allowed."""
    eos = tokenizer.eos_token_id
    prompt = tokenizer.encode(PROMPT_TEXT)
    decoder = SpeculativeDecoder(target, draft, eos_token_ids=[eos])
    config = FLY_CONFIGS["fly, ngram"]
    events = list(decoder.stream(prompt, config, grammar=grammar))
    tokens = [event.token for event in events]
    assert "loose" in {event.origin for event in events}
    assert answer_is_allowed(grammar, tokens)


def test_sampled_speculative_decoding_draws_from_the_masked_target(target, draft, tokenizer):
    """A string of letters a-m: the first token can only be the quote, the second is drawn
    from the target's distribution after it, masked to those letters. Speculative sampling
    with a sampled draft must reproduce it (unmasked it is far away)."""
    eos = tokenizer.eos_token_id
    grammar_tokenizer = GrammarTokenizer(tokenizer, vocab_size=DECODE_VOCAB, eos_token_ids=[eos])
    letters = json_schema_grammar({"type": "string", "pattern": "^[a-m]+$"}, grammar_tokenizer)
    prompt = tokenizer.encode(PROMPT_TEXT)
    quote = tokenizer.encode('"')
    sampling = SamplingConfig(temperature=1.5)
    with torch.inference_mode():
        logits = target(input_ids=torch.tensor([prompt + quote])).logits[0, -1]
    allowed = allowed_after(letters, quote)
    expected = sampling_probs(logits.masked_fill(~allowed, -math.inf), sampling).float()
    unmasked = sampling_probs(logits, sampling).float()
    assert binned_distance(unmasked, expected, bins=6) > 0.3
    decoder = SpeculativeDecoder(target, draft, eos_token_ids=[eos])
    histogram = token_histogram(decoder, prompt, sampling, trials=400, position=1, grammar=letters)
    assert binned_distance(histogram, expected, bins=6) < 0.08
