"""Text in, text out: incremental detokenisation, stop strings, chat prompts, results."""

import pytest

from flyspec.config import DecodeConfig
from flyspec.decoding.stats import RequestStats
from flyspec.engine import Engine, StopTextDecoder
from flyspec.errors import FlyspecError
from tests.tiny import make_tiny_model, make_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def engine(tokenizer):
    return Engine(
        target_model=make_tiny_model(vocab_size=len(tokenizer), seed=5),
        draft_model=make_tiny_model(vocab_size=len(tokenizer), seed=6),
        tokenizer=tokenizer,
    )


def feed(decoder, text, tokenizer):
    pieces = [decoder.add(token) for token in tokenizer.encode(text)]
    return pieces + [decoder.flush()]


def test_decoder_releases_the_whole_text(tokenizer):
    decoder = StopTextDecoder(tokenizer)
    assert "".join(feed(decoder, "def fibonacci(n):\n    return n", tokenizer)) == (
        "def fibonacci(n):\n    return n"
    )


def test_stop_string_is_cut_and_never_released(tokenizer):
    decoder = StopTextDecoder(tokenizer, stop=("\n\n",))
    released = "".join(feed(decoder, "def f():\n    return 1\n\nprint(f())", tokenizer))
    assert released == "def f():\n    return 1"
    assert decoder.stopped


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer):
    decoder = StopTextDecoder(tokenizer, stop=("return 2",))
    released = "".join(decoder.add(token) for token in tokenizer.encode("x = 1\nreturn "))
    assert released == "x = 1\n"  # "return " could still become "return 2"
    released += "".join(decoder.add(token) for token in tokenizer.encode("1"))
    assert released + decoder.flush() == "x = 1\nreturn 1"
    assert not decoder.stopped


@pytest.mark.parametrize("mode", ["spd", "target"])  # the target alone runs ahead
def test_generate_applies_stop_strings(engine, mode):
    full = engine.generate("def f", DecodeConfig(mode=mode, k=4, max_new_tokens=30))
    assert len(full.text) > 4
    stop = full.text[2:4]
    cut = engine.generate("def f", DecodeConfig(mode=mode, k=4, max_new_tokens=30, stop=(stop,)))
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.stats.finish_reason == "stop"
    assert len(cut.token_ids) <= len(full.token_ids)


def test_generate_result_matches_the_target_alone(engine):
    fly_off = engine.generate("for i in", DecodeConfig(mode="spd", max_new_tokens=20))
    target = engine.generate("for i in", DecodeConfig(mode="target", max_new_tokens=20))
    assert fly_off.token_ids == target.token_ids
    assert fly_off.text == target.text
    assert fly_off.as_dict()["stats"]["emitted"] == len(fly_off.token_ids)


def test_chat_prompt_uses_the_template(engine, tokenizer):
    ids = engine.encode("hi", chat=True)
    assert tokenizer.decode(ids).startswith("<|im_start|>user\nhi<|im_end|>")


@pytest.mark.parametrize("prompt", ["", "   "])
def test_empty_prompt_is_refused(engine, prompt):
    with pytest.raises(FlyspecError, match="empty"):
        engine.encode(prompt)


def test_empty_messages_are_refused(engine):
    with pytest.raises(FlyspecError, match="empty"):
        engine.encode_messages([])


def test_prompt_plus_budget_past_the_context_is_refused(engine):
    too_many = engine.context_length  # the tiny models hold 1024 positions
    with pytest.raises(FlyspecError, match="exceeds the model's context"):
        engine.generate("def f", DecodeConfig(max_new_tokens=too_many))


def test_a_requested_stop_ends_the_request_and_releases_held_back_text(engine):
    full = engine.generate("def f", DecodeConfig(mode="spd", k=4, max_new_tokens=30))
    first_three = engine.tokenizer.decode(full.token_ids[:3])
    assert first_three and "\ufffd" not in first_three
    # A stop string that begins with the text's last character and never completes: that
    # character is held back until the request ends.
    config = DecodeConfig(mode="spd", k=4, max_new_tokens=30, stop=(first_three[-1] + "\x00",))
    chunks = list(engine.stream(engine.encode("def f"), config, should_stop=lambda: True))
    assert [c.token for c in chunks if c.token is not None] == full.token_ids[:1]
    first = engine.tokenizer.decode(full.token_ids[:1])
    assert "".join(c.text for c in chunks) == first

    calls = []
    stats = RequestStats()
    chunks = list(
        engine.stream(
            engine.encode("def f"),
            config,
            stats=stats,
            should_stop=lambda: calls.append(1) or len(calls) >= 3,
        )
    )
    assert [c.token for c in chunks if c.token is not None] == full.token_ids[:3]
    assert "".join(c.text for c in chunks) == first_three
    assert chunks[-1].token is None and chunks[-1].text == first_three[-1]
    assert stats.finish_reason == "cancelled" and stats.emitted == 3


def _byte_level_tokenizer():
    """A byte-level BPE (GPT-2's and Qwen's kind): a character may span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["def f(x):\n    return x  # é ü 漢字 🙂"] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _metaspace_tokenizer():
    """A SentencePiece-style word tokenizer whose decoder drops a text's leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["▁def", "▁return", "▁x", "▁f(x):", "▁+", "▁1", "\n", "<unk>"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


@pytest.mark.parametrize("make", [make_tiny_tokenizer, _byte_level_tokenizer, _metaspace_tokenizer])
def test_incremental_text_is_the_whole_decode(make):
    """Token by token, the released text (which decodes a short window per token) is what
    decoding the whole sequence at once gives, for any sequence of ids, characters split
    over tokens included."""
    import random

    tokenizer = make()
    whole = lambda ids: tokenizer.decode(  # noqa: E731
        ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        decoder = StopTextDecoder(tokenizer)
        released = "".join(decoder.add(token) for token in ids) + decoder.flush()
        # Text ending in an unfinished character is held back until a token completes it.
        ends = [j for j in range(len(ids) + 1) if not whole(ids[:j]).endswith("\ufffd")]
        assert released == whole(ids[: max(ends)]), ids


def test_a_prompt_goes_through_the_chat_template_by_default_where_there_is_one(engine):
    assert engine.has_chat_template
    assert engine.encode("hi", chat=None) == engine.encode("hi", chat=True)
    assert engine.encode("hi", chat=False) != engine.encode("hi", chat=True)
    plain = Engine(
        target_model=engine.target_model, tokenizer=make_tiny_tokenizer(), draft_model=None
    )
    plain.tokenizer.chat_template = None
    assert not plain.has_chat_template
    assert plain.encode("hi", chat=None) == plain.encode("hi", chat=False)
