"""The user-facing engine: a loaded model pair plus text in, text out.

``Engine.stream`` yields text pieces as tokens are committed and applies stop strings;
``Engine.generate`` runs one request to the end and returns the text with its statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from flyspec.config import DecodeConfig, KernelConfig, LlamaCppConfig
from flyspec.decoding.drafters import Drafter
from flyspec.decoding.grammar import Grammar, GrammarTokenizer, json_schema_grammar
from flyspec.decoding.logprobs import TokenLogprob
from flyspec.decoding.loop import Origin, SpeculativeDecoder, TokenEvent
from flyspec.decoding.stats import RequestStats
from flyspec.errors import FlyspecError
from flyspec.models.cache import LanguageModel
from flyspec.models.llamacpp import LlamaCppLM
from flyspec.models.pair import LoadedPair, describe_kernels, end_token_ids, load_pair


class StopTextDecoder:
    """Incremental detokenisation that releases text only when it is final.

    Text that could still become a stop string is held back; once a stop string appears the
    text is cut right before it and :attr:`stopped` turns True. An incomplete UTF-8 sequence at
    the end (decoded as U+FFFD) is held back until the next token completes it.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.token_ids: list[int] = []
        self.text = ""
        self.released = 0
        self.stopped = False
        # A short window is decoded per token, not the whole: self.text holds the text of
        # token_ids[:read], and the window starts at the tokens added before those that are
        # new, so that a decoder that treats a text's first token apart (SentencePiece's
        # leading space) decodes the new tokens as it does within the whole.
        self._window = 0
        self._read = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def add(self, token: int) -> str:
        """Take one token; return the text that became final with it (maybe empty)."""
        if self.stopped:
            return ""
        self.token_ids.append(token)
        after = self._decode(self.token_ids[self._window :])
        if after.endswith("\ufffd"):
            return ""
        before = self._decode(self.token_ids[self._window : self._read])
        if before and after.startswith(before):
            text = self.text + after[len(before) :]
        else:  # the window's first text is its new token's (a skipped token before it): whole
            text = self._decode(self.token_ids)
        self._window, self._read = self._read, len(self.token_ids)
        self.text = text
        stop_at = self._first_stop(text)
        if stop_at is not None:
            self.stopped = True
            self.text = text[:stop_at]
            return self._release(stop_at)
        return self._release(len(text) - self._held_back(text))

    def flush(self) -> str:
        """At the end of generation: everything not yet released."""
        return "" if self.stopped else self._release(len(self.text))

    def _release(self, end: int) -> str:
        piece = self.text[self.released : max(end, self.released)]
        self.released = max(end, self.released)
        return piece

    def _first_stop(self, text: str) -> int | None:
        found = [
            index
            for stop in self.stop
            if (index := text.find(stop, max(0, self.released - len(stop) + 1))) >= 0
        ]
        return min(found) if found else None

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        return held_back(text, self.stop)


def held_back(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that begins one of ``markers`` (but is not
    all of it): text a streamed answer holds back until it is known not to start one."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest


@dataclass(frozen=True)
class TextChunk:
    """Text released after one committed token, with how that token was obtained. The last
    chunk of a request may carry held-back text only (``token`` None)."""

    text: str
    token: int | None
    origin: Origin
    logprob: TokenLogprob | None = None


@dataclass
class GenerationResult:
    """A finished request."""

    text: str
    token_ids: list[int]
    origins: list[Origin]
    stats: RequestStats = field(default_factory=RequestStats)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)  # where asked for

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.as_dict()}


class Engine:
    """A target model, an optional draft model sharing its tokenizer, and the tokenizer.

    :meth:`load` (or :meth:`from_pair` over :func:`flyspec.models.pair.load_pair`) loads a
    pair by name; the constructor takes models already built: torch modules (run by
    ``forward_path``) or language models. ``kernels``: what runs them, as reports and caches
    give it (by default :func:`~flyspec.models.pair.describe_kernels`)."""

    def __init__(
        self,
        *,
        target_model: torch.nn.Module | LanguageModel,
        tokenizer,
        draft_model: torch.nn.Module | LanguageModel | None = None,
        target_name: str = "target",
        draft_name: str | None = None,
        forward_path: str = "auto",
        kernels: dict | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.target_name = target_name
        self.draft_name = draft_name
        self.decoder = SpeculativeDecoder(
            target_model,
            draft_model,
            eos_token_ids=end_token_ids(tokenizer, target_model),
            forward_path=forward_path,
        )
        self.backend = "llamacpp" if isinstance(self.decoder.target, LlamaCppLM) else "torch"
        self.kernels: dict = (
            dict(kernels)
            if kernels is not None
            else describe_kernels(target=self.decoder.target, draft=self.decoder.draft)
        )
        self._grammar_tokenizer: GrammarTokenizer | None = None

    @classmethod
    def from_pair(cls, pair: LoadedPair) -> Engine:
        """The engine over a pair :func:`~flyspec.models.pair.load_pair` loaded; ``-k auto``'s
        measured forward costs are kept for it (:meth:`keep_forward_costs`)."""
        engine = cls(
            target_model=pair.target,
            draft_model=pair.draft,
            tokenizer=pair.tokenizer,
            target_name=pair.target_name,
            draft_name=pair.draft_name,
            kernels=pair.kernels,
        )
        engine.keep_forward_costs(pair.cost_settings)
        return engine

    def keep_forward_costs(self, settings: dict) -> None:
        """Keep ``-k auto``'s measured forward costs under ``$FLYSPEC_HOME`` for these models,
        kernels and ``settings`` (what else their speed depends on) on this machine: a later
        process starts from them instead of probing
        (:func:`flyspec.decoding.auto_k.store.costs_store`)."""
        from flyspec.decoding.auto_k.store import costs_store
        from flyspec.models.identity import model_identity

        names = {"target": self.target_name, "draft": self.draft_name}
        identity = {
            **{role: model_identity(name) for role, name in names.items() if name},
            "kernels": self.kernels,
            **settings,
        }
        self.decoder.auto_k_store = costs_store(identity)

    @property
    def target_model(self) -> torch.nn.Module | None:
        """The target's torch module (None on the llama.cpp backend)."""
        return self.decoder.target.model

    @property
    def draft_model(self) -> torch.nn.Module | None:
        """The draft's torch module (None without a draft, and on the llama.cpp backend)."""
        return None if self.decoder.draft is None else self.decoder.draft.model

    @property
    def has_draft(self) -> bool:
        """Whether a draft model is loaded, on either backend (the ``model`` and ``mla``
        drafters need one)."""
        return self.decoder.draft is not None

    @property
    def grammar_tokenizer(self) -> GrammarTokenizer:
        """The tokenizer as the grammar engine reads it (every token's bytes, read once)."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = GrammarTokenizer(
                self.tokenizer,
                vocab_size=self.vocab_size,
                eos_token_ids=self.decoder.eos_token_ids,
            )
        return self._grammar_tokenizer

    def json_grammar(self, schema: dict | None = None) -> Grammar:
        """The grammar of the answers ``schema`` (a JSON schema) allows, for :meth:`stream`'s
        ``grammar``; None: any JSON object. :class:`FlyspecError` naming the problem for a
        schema the grammar engine cannot use."""
        return json_schema_grammar(schema, self.grammar_tokenizer)

    @property
    def vocab_size(self) -> int:
        """Rows of the target's logits: the token ids a request can name."""
        return self.decoder.vocab_size

    @property
    def context_length(self) -> int:
        """The most positions (prompt + generated) the target model supports."""
        if self.backend == "llamacpp":
            return self.decoder.target.context_length
        return int(getattr(self.target_model.config, "max_position_embeddings", 0) or 2**31 - 1)

    @classmethod
    def load(
        cls,
        *,
        target: str | None = None,
        draft: str | None = None,
        with_draft: bool = True,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        kernels: KernelConfig | None = None,
        backend: str = "torch",
        llamacpp: LlamaCppConfig | None = None,
    ) -> Engine:
        """Load a pair by name and build the engine over it: :func:`~flyspec.models.pair.load_pair`
        (the same arguments) then :meth:`from_pair`. By default the embedded default pair on
        the kernels every ``flyspec`` command uses, so that the library gives the commands'
        tokens; ``backend="llamacpp"``: GGUF files run by llama.cpp."""
        return cls.from_pair(
            load_pair(
                target=target,
                draft=draft,
                with_draft=with_draft,
                device=device,
                dtype=dtype,
                kernels=kernels,
                backend=backend,
                llamacpp=llamacpp,
            )
        )

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer has a chat template."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: str, *, chat: bool | None = False) -> list[int]:
        """Token ids of a raw prompt, or of a one-turn chat when ``chat`` is set (None: when
        the tokenizer has a chat template, as the commands' ``--chat`` defaults to)."""
        if not prompt or not prompt.strip():
            raise FlyspecError("the prompt is empty")
        if chat is None:
            chat = self.has_chat_template
        if chat:
            return self.encode_messages([{"role": "user", "content": prompt}])
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def encode_infill(
        self,
        prefix: str,
        suffix: str,
        *,
        files: Sequence[tuple[str, str]] = (),
        middle: str = "",
    ) -> list[int]:
        """Token ids of a fill-in-the-middle prompt: the text before the gap and the text
        after it, around the model's own FIM tokens, prefix first (the order Qwen2.5-Coder
        and StarCoder were trained with); the answer is the middle, which ``middle`` starts.
        ``files``: ``(name, text)`` of other files of the project, put before, in the
        model's repository format where it has one (``<|repo_name|>``, ``<|file_sep|>`` and a
        file's name on its first line), else as text, each file's name on a line before it.
        FlyspecError for a tokenizer with none of the known FIM tokens."""
        marks = fim_tokens(self.tokenizer)
        if marks is None:
            known = "; ".join(" ".join(family) for family in FIM_TOKENS)
            raise FlyspecError(
                f"this model has no fill-in-the-middle tokens (known: {known}): send the "
                "prompt without a suffix"
            )
        before, after, answer = marks

        def text(part: str) -> list[int]:
            return list(self.tokenizer.encode(part, add_special_tokens=False)) if part else []

        context: list[int] = []
        repository = repository_tokens(self.tokenizer)
        if files and repository is not None:  # as llama-server lays it out, names included
            repo, separator = repository
            context = [repo, *text("myproject\n")]
            for name, content in files:
                context += [separator, *text(f"{name}\n"), *text(content)]
            context += [separator, *text("filename\n")]
        elif files:
            context = text("".join(f"{name}\n{content}\n\n" for name, content in files))
        return [*context, before, *text(prefix), after, *text(suffix), answer, *text(middle)]

    def render_messages(self, messages: Sequence[dict], *, tools: Sequence[dict] = ()) -> str:
        """A conversation as the tokenizer's chat template writes it, ending where the
        assistant's answer starts; with ``tools`` (OpenAI's form), as the template shows
        them to the model."""
        if not messages:
            raise FlyspecError("messages must not be empty")
        if not self.has_chat_template:
            raise FlyspecError("this tokenizer has no chat template; send a raw prompt instead")
        return self.tokenizer.apply_chat_template(
            list(messages), tools=list(tools) or None, tokenize=False, add_generation_prompt=True
        )

    def encode_messages(self, messages: Sequence[dict], *, tools: Sequence[dict] = ()) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template
        (:meth:`render_messages`)."""
        text = self.render_messages(messages, tools=tools)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prediction(self, prediction: str) -> list[int]:
        """Token ids of a predicted answer (:func:`prediction_token_ids`; an empty one is
        refused where the request starts, by its drafter)."""
        return prediction_token_ids(self.tokenizer, prediction)

    def check_prediction(self, prompt_ids: Sequence[int], prediction_ids: Sequence[int]) -> None:
        """FlyspecError unless the prediction fits in the context after the prompt (the
        answer it predicts would not)."""
        room = self.context_length - len(prompt_ids)
        if len(prediction_ids) > room:
            raise FlyspecError(
                f"the prediction ({len(prediction_ids)} tokens) does not fit in the model's "
                f"context of {self.context_length} tokens after the prompt ({len(prompt_ids)} "
                "tokens)"
            )

    def prompt_logprobs(
        self, prompt_ids: Sequence[int], *, top: int = 0
    ) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability under the target, with ``top`` alternatives
        (None for the first token; :meth:`SpeculativeDecoder.prompt_logprobs`)."""
        if len(prompt_ids) > self.context_length:
            raise FlyspecError(
                f"the prompt ({len(prompt_ids)} tokens) exceeds the model's context of "
                f"{self.context_length} tokens"
            )
        return self.decoder.prompt_logprobs(prompt_ids, top=top)

    def stream(
        self,
        prompt_ids: Sequence[int],
        config: DecodeConfig,
        *,
        stats: RequestStats | None = None,
        should_stop: Callable[[], bool] | None = None,
        drafter: Drafter | None = None,
        prediction: Sequence[int] | None = None,
        logprobs: int | None = None,
        grammar: Grammar | None = None,
    ) -> Iterator[TextChunk]:
        """Yield text as tokens are committed; stops at a stop string (excluded), EOS or
        ``config.max_new_tokens``.

        ``should_stop`` is asked after each committed token; when it answers True the request
        ends there (``stats.finish_reason`` "cancelled") and the text held back so far is
        still released, as at any end. Closing the iterator instead drops that text.
        ``drafter``: any :class:`~flyspec.decoding.drafters.Drafter` instead of
        ``config.drafter``'s.
        ``prediction``: token ids the answer is expected to largely repeat
        (:meth:`encode_prediction`), drafted from first. ``logprobs``: each chunk of a token
        carries its log-probability, with that many alternatives
        (:meth:`SpeculativeDecoder.stream`). ``grammar``: the answer follows it
        (:meth:`json_grammar`).
        """
        if prediction is not None:
            self.check_prediction(prompt_ids, prediction)
        if len(prompt_ids) + config.max_new_tokens > self.context_length:
            raise FlyspecError(
                f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens "
                f"({config.max_new_tokens}) exceeds the model's context of "
                f"{self.context_length} tokens"
            )
        stats = stats if stats is not None else RequestStats()
        text = StopTextDecoder(self.tokenizer, config.stop)
        events: Iterator[TokenEvent] = self.decoder.stream(
            prompt_ids,
            config,
            stats=stats,
            drafter=drafter,
            prediction=prediction,
            logprobs=logprobs,
            grammar=grammar,
        )
        last: TokenEvent | None = None
        try:
            for event in events:
                last = event
                piece = text.add(event.token)
                yield TextChunk(
                    text=piece, token=event.token, origin=event.origin, logprob=event.logprob
                )
                if text.stopped or (should_stop is not None and should_stop()):
                    break
        finally:
            events.close()
        if text.stopped:
            stats.finish_reason = "stop"
        elif last is not None:
            tail = text.flush()
            if tail:
                yield TextChunk(text=tail, token=None, origin=last.origin)

    def generate(
        self,
        prompt: str | Sequence[int],
        config: DecodeConfig,
        *,
        chat: bool = False,
        drafter: Drafter | None = None,
        prediction: str | Sequence[int] | None = None,
        logprobs: int | None = None,
        grammar: Grammar | None = None,
    ) -> GenerationResult:
        """Run one request to the end (``drafter``, ``logprobs`` and ``grammar`` as in
        :meth:`stream`;
        ``prediction``: the text, or token ids, the answer is expected to largely repeat)."""
        prompt_ids = self.encode(prompt, chat=chat) if isinstance(prompt, str) else prompt
        if isinstance(prediction, str):
            prediction = self.encode_prediction(prediction)
        stats = RequestStats()
        pieces: list[str] = []
        token_ids: list[int] = []
        origins: list[Origin] = []
        records: list[TokenLogprob | None] = []
        chunks = self.stream(
            prompt_ids,
            config,
            stats=stats,
            drafter=drafter,
            prediction=prediction,
            logprobs=logprobs,
            grammar=grammar,
        )
        for chunk in chunks:
            pieces.append(chunk.text)
            if chunk.token is not None:
                token_ids.append(chunk.token)
                origins.append(chunk.origin)
                records.append(chunk.logprob)
        return GenerationResult(
            text="".join(pieces),
            token_ids=token_ids,
            origins=origins,
            stats=stats,
            logprobs=records if logprobs is not None else [],
        )


FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
)
"""The fill-in-the-middle tokens of the model families flyspec knows: before the prefix,
before the suffix, before the middle (the answer)."""


REPOSITORY_TOKENS = (
    ("<|repo_name|>", "<|file_sep|>"),  # Qwen2.5-Coder
    ("<reponame>", "<file_sep>"),  # StarCoder
)
"""The tokens of a repository-level prompt: before the project's name, before each file."""


def repository_tokens(tokenizer) -> tuple[int, int] | None:
    """The ids of the first pair of :data:`REPOSITORY_TOKENS` the tokenizer has, or None."""
    return _first_family(tokenizer, REPOSITORY_TOKENS)


def fim_tokens(tokenizer) -> tuple[int, int, int] | None:
    """The ids of the first family of :data:`FIM_TOKENS` whose three tokens the tokenizer
    has, or None."""
    return _first_family(tokenizer, FIM_TOKENS)


def _first_family(tokenizer, families: Sequence[tuple[str, ...]]) -> tuple[int, ...] | None:
    """The ids of the first of ``families`` whose tokens the tokenizer all has, or None."""
    vocabulary = tokenizer.get_vocab()
    for family in families:
        if all(token in vocabulary for token in family):
            return tuple(vocabulary[token] for token in family)
    return None


def prediction_token_ids(tokenizer, prediction: str) -> list[int]:
    """Token ids of a predicted answer (Predicted Outputs), tokenized as answer text is: no
    special tokens added."""
    return list(tokenizer.encode(prediction, add_special_tokens=False))
