"""Structured outputs: a grammar (a JSON schema) that masks the target's distribution before
verification and the draft model's before it proposes, compiled and matched by llguidance.

The engine was chosen by measurement (``benchmarks/grammar_engines.py``, docs/server.md):
llguidance and xgrammar both compile, enforce and roll back every schema of the set; xgrammar
computes a mask faster, llguidance compiles a schema 3-36 times faster and installs with no
dependencies (xgrammar brings Triton), and either's masks for a block of 8 take 0.1-0.6 ms.

How a round stays inside the grammar, whatever verifies it:

- a block is cut before its first token the grammar forbids (a prediction or a lookup can
  break it): nothing past that point is verified;
- row ``i`` of the target's ``[K+1, V]`` logits is masked by the grammar's state after the
  answer and draft tokens ``0..i-1``; a forbidden token gets -inf, which no rule keeps (exact,
  sampled or FLy's loosened acceptance: :func:`~flyspec.decoding.verify.verify_greedy` never
  keeps a token of probability zero), and the entropy gate reads the masked distribution;
- the draft model chooses each token from its logits masked the same way.

The matcher follows the request's context (the answer after the prompt): it rolls back over
whatever left the context (rejected draft tokens, a rolled-back deferral) and consumes what
came in, so no caller has to tell it what was kept.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flyspec.errors import FlyspecError
from flyspec.models.cache import DeviceTokens, common_prefix_length

if TYPE_CHECKING:
    from flyspec.decoding.drafters.base import Draft

JSON_OBJECT_SCHEMA = {"type": "object"}
"""What ``response_format`` ``json_object`` asks for: any JSON object (OpenAI's meaning)."""
JSON_WHITESPACE = r"(\n[ \t]{0,24}|[ \t]{1,4})"
"""The whitespace allowed between two tokens of JSON: a line break and an indentation of up
to 24 spaces or tabs, or up to 4 spaces. Without a bound a model can loop on whitespace to
its token budget (the test suite's random models do); pretty-printed JSON fits, nested 12
levels at two spaces."""


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as error:  # a broken install: llguidance is a dependency
        raise FlyspecError(
            "structured outputs need llguidance: pip install 'llguidance>=1.9'"
        ) from error
    return llguidance


class GrammarTokenizer:
    """A tokenizer as the grammar engine reads it: every token's bytes, the model's vocabulary
    size (a head padded past the tokenizer's tokens: those are never allowed) and the tokens
    that end a request (allowed only where the grammar is complete). Made once a model."""

    def __init__(self, tokenizer, *, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        llguidance = _llguidance()
        ends = sorted(eos_token_ids) or [tokenizer.eos_token_id]
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.end_tokens = frozenset(ends)
        try:
            self.engine_tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=vocab_size, eos_token=ends
            )
        except ValueError:  # a decoder the engine does not read (not byte-level BPE)
            wrapper = llguidance.TokenizerWrapper(_TokenTexts(tokenizer, vocab_size, ends[0]))
            self.engine_tokenizer = llguidance.LLTokenizer(
                wrapper, n_vocab=vocab_size, eos_token=ends
            )


class _TokenTexts:
    """A tokenizer as the engine's generic wrapper reads it: each token's text as bytes (a
    tokenizer whose tokens are whole characters, as the test suite's), its special tokens,
    and its encoder."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.bos_token_id = None
        self.special_token_ids = list(tokenizer.all_special_ids)
        names = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        texts = [tokenizer.convert_tokens_to_string([name]) for name in names]
        self.tokens = [text.encode() for text in texts] + [b""] * (vocab_size - len(texts))

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class Grammar:
    """A grammar checked against one tokenizer: llguidance's ``source``, and ``description``,
    what it was made from, for messages."""

    source: str
    tokenizer: GrammarTokenizer
    description: str


def json_schema_grammar(schema: dict[str, Any] | None, tokenizer: GrammarTokenizer) -> Grammar:
    """The grammar of the JSON values ``schema`` allows (None: any JSON object, as
    ``json_object`` asks). A schema the engine cannot use gets a :class:`FlyspecError` that
    says why (an unknown type or format, a broken pattern, a ``$ref`` to nowhere)."""
    llguidance = _llguidance()
    schema = JSON_OBJECT_SCHEMA if schema is None else schema
    if not isinstance(schema, dict):
        raise FlyspecError(f"a JSON schema is a JSON object, not {type(schema).__name__}")
    try:
        source = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_pattern": JSON_WHITESPACE}
        )
    except (ValueError, TypeError) as error:
        raise FlyspecError(f"the JSON schema cannot be used: {error}") from error
    return _checked(source, tokenizer, description="the JSON schema")


def lark_grammar(source: str, tokenizer: GrammarTokenizer, *, description: str) -> Grammar:
    """The grammar of a Lark ``source`` (llguidance's dialect: :func:`lark_json` embeds a
    JSON schema, :func:`lark_literal` a text that may be one token). :class:`FlyspecError`
    naming the problem for a grammar the engine cannot use."""
    grammar = _llguidance().LLMatcher.grammar_from_lark(source)
    return _checked(grammar, tokenizer, description=description)


def _checked(source: str, tokenizer: GrammarTokenizer, *, description: str) -> Grammar:
    """The grammar of llguidance's ``source``, checked against ``tokenizer``
    (:class:`FlyspecError` naming ``description`` and the problem where it cannot be used;
    warnings pass)."""
    problem = _llguidance().LLMatcher.validate_grammar(source, tokenizer.engine_tokenizer)
    if problem and not problem.startswith("WARNING"):
        raise FlyspecError(f"{description} cannot be used: {_one_line(problem)}")
    return Grammar(source=source, tokenizer=tokenizer, description=description)


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark item matching the JSON values ``schema`` allows, its whitespace bounded as
    :func:`json_schema_grammar`'s."""
    guidance = {"whitespace_pattern": JSON_WHITESPACE, **schema.get("x-guidance", {})}
    return "%json " + json.dumps({**schema, "x-guidance": guidance})


def lark_literal(text: str, tokenizer: GrammarTokenizer) -> str:
    """A Lark item matching ``text``: the token itself where ``text`` is one token of the
    vocabulary added to it (such as ``<tool_call>``: the engine reads added tokens apart from
    their text), else the string."""
    token = tokenizer.tokenizer.convert_tokens_to_ids(text)
    added = getattr(tokenizer.tokenizer, "added_tokens_encoder", {})
    if isinstance(token, int) and text in added:
        return f"<[{token}]>"
    return json.dumps(text)


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def _unpacked(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    """The engine's bit masks as ``uint8[R, vocab_size]``, 1 where allowed (0 past them)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    return np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])))


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The engine's bit masks ``int32[R, ceil(V'/32)]`` (bit ``t % 32`` of word ``t // 32``
    set where token ``t`` is allowed) as ``bool[R, vocab_size]``; tokens past the mask's
    ``V'`` are not allowed."""
    return torch.from_numpy(_unpacked(bitmask, vocab_size).astype(bool))


_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)  # what a token allowed (1) or not (0) adds


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[R, V]`` with -inf where the engine's bit masks ``int32[R, W]`` (on the
    host; :func:`allowed_tokens`) forbid a token. On the CPU as one addition of a bias of 0
    and -inf (torch adds faster than it fills a masked tensor); elsewhere the masks are
    copied packed (4 bytes for 32 tokens) and unpacked on the device."""
    vocab_size = logits.shape[-1]
    if logits.device.type == "cpu":
        bias = np.take(_BIAS, _unpacked(bitmask, vocab_size))
        return logits + torch.from_numpy(bias).to(logits.dtype)
    allowed = unpacked_on(bitmask, vocab_size, device=logits.device)
    return logits.masked_fill(~allowed, -math.inf)


def unpacked_on(bitmask: torch.Tensor, vocab_size: int, *, device: torch.device) -> torch.Tensor:
    """:func:`allowed_tokens` computed on ``device`` from the packed masks copied there."""
    packed = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((packed[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    return allowed[:, :vocab_size]


class RequestGrammar:
    """One request's grammar matcher, following the request's context ``tokens`` (its answer
    starts after ``prompt_length`` tokens)."""

    def __init__(self, grammar: Grammar, *, tokens: DeviceTokens, prompt_length: int) -> None:
        llguidance = _llguidance()
        self.grammar = grammar
        self.tokens = tokens
        self.prompt_length = prompt_length
        self.vocab_size = grammar.tokenizer.vocab_size
        self._llguidance = llguidance
        self._matcher = llguidance.LLMatcher(
            grammar.tokenizer.engine_tokenizer, grammar.source, log_level=0
        )
        if self._matcher.is_error():
            raise FlyspecError(f"the grammar cannot be used: {self._matcher.get_error()}")
        self._consumed: list[int] = []
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)

    def allowed_prefix(self, block: Sequence[int], *, after: Sequence[int] = ()) -> int:
        """How many leading tokens of ``block`` the grammar allows after the answer and
        ``after`` (tokens drafted since)."""
        self._follow(after)
        return self._matcher.validate_tokens(list(block))

    def cut(self, draft: Draft) -> Draft:
        """``draft`` before its first token the grammar forbids (read, where it was not)."""
        ids = draft.token_ids
        allowed = self.allowed_prefix(ids)
        if allowed == len(ids) and not draft.unread:
            return draft
        return draft.settled(ids, allowed)

    def allowed(self, block: Sequence[int] = (), *, after: Sequence[int] = ()) -> torch.Tensor:
        """``bool[len(block) + 1, V]``: the tokens allowed before each of ``block`` and after
        it, after the answer and ``after`` (:meth:`masks`, unpacked)."""
        return allowed_tokens(self.masks(block, after=after), self.vocab_size)

    def masks(self, block: Sequence[int] = (), *, after: Sequence[int] = ()) -> torch.Tensor:
        """The engine's bit masks ``int32[len(block) + 1, W]`` of the tokens allowed before
        each of ``block`` and after it, after the answer and ``after``. Rows after a
        forbidden token of ``block``, or an end token, allow every token (verification cuts
        the block there and never reads them). An end token is never consumed: the engine
        does not count it as a token it can roll back."""
        self._follow(after)
        rows = len(block) + 1
        if self._bitmask.shape[0] < rows:
            self._bitmask = self._llguidance.torch.allocate_token_bitmask(rows, self.vocab_size)
        masks = self._bitmask[:rows]
        masks.fill_(-1)
        ends = self.grammar.tokenizer.end_tokens
        valid = self._matcher.validate_tokens(list(block))  # a forbidden token would break it
        consumed = 0
        for row in range(rows):
            self._llguidance.torch.fill_next_token_bitmask(self._matcher, self._bitmask, row)
            if row == valid or block[row] in ends:
                break
            self._matcher.consume_token(block[row])
            consumed += 1
        if consumed:
            self._matcher.rollback(consumed)
        return masks

    def apply(
        self,
        logits: torch.Tensor,
        *,
        after: Sequence[int] = (),
        block: Sequence[int] = (),
    ) -> torch.Tensor:
        """``logits`` ``[len(block) + 1, V]`` masked by :meth:`masks`."""
        return masked_logits(logits, self.masks(block, after=after))

    def _follow(self, after: Sequence[int]) -> None:
        """Bring the matcher to the answer followed by ``after``: roll back what it consumed
        past their common prefix, consume the rest."""
        target = self.tokens.ids[self.prompt_length :]
        if after:
            target = target + list(after)
        consumed = self._consumed
        common = common_prefix_length(consumed, target)
        if common < len(consumed):
            self._matcher.rollback(len(consumed) - common)
            del consumed[common:]
        new = target[common:]
        if new:
            if not self._matcher.consume_tokens(new):
                raise RuntimeError(
                    f"a token the grammar forbids reached the context: {self._matcher.get_error()}"
                )
            consumed.extend(new)
