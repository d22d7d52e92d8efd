"""Speed at a recorded acceptance: traces of real rounds, replayed on any pair of models.

On random weights every draft is wrong, so a GPU run of random models of the real shapes says
what a round costs but nothing about how many tokens a round keeps. A *trace* records, for each
request of a real run, every round's block size, how many of its drafted tokens were kept
(exactly or loosely) and where they came from (:data:`~flyspec.decoding.drafters.base.DraftSource`).
Replayed (:class:`ReplayDecoder`), each round runs as the real one did: the drafter the trace's
method names drafts its block (the draft model's forwards run; a prediction's blocks cost
nothing), the target scores it in one forward and the verification runs; only the decision of
how many tokens are kept is the trace's, so the speed is the one these models would reach at the
real pair's acceptance. The tokens are the target's own greedy tokens (a reference decoded
before): kept positions propose them, the cut proposes a wrong token, and the round's next
token is the reference's.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from flyspec.config import DecodeConfig
from flyspec.decoding.drafters import Draft, Drafter, NgramDrafter, make_drafter
from flyspec.decoding.loop import SpeculativeDecoder, TokenEvent
from flyspec.decoding.stats import RequestStats
from flyspec.decoding.verify import Verdict
from flyspec.errors import FlyspecError
from flyspec.models.cache import DeviceTokens

TRACE_FORMAT = 1
_SOURCES = frozenset({"model", "lookup", "prediction"})


@dataclass(frozen=True)
class TracedRound:
    """One recorded round: ``drafted`` tokens proposed, ``kept`` of them kept (exact and loose),
    drafted by ``source`` (None: the round drafted nothing)."""

    drafted: int
    kept: int
    source: str | None

    def __post_init__(self) -> None:
        if not 0 <= self.kept <= self.drafted:
            raise FlyspecError(f"a round keeps 0 to {self.drafted} tokens, not {self.kept}")
        if self.source is not None and self.source not in _SOURCES:
            raise FlyspecError(f"unknown draft source {self.source!r}")

    @property
    def committed(self) -> int:
        """Tokens the round commits: the kept ones and the correction or bonus."""
        return self.kept + 1


@dataclass(frozen=True)
class TracedRequest:
    """A request's rounds and the length of its prompt."""

    prompt_tokens: int
    rounds: tuple[TracedRound, ...]

    @property
    def tokens(self) -> int:
        return sum(r.committed for r in self.rounds)


@dataclass(frozen=True)
class Trace:
    """The rounds of one method on a set of prompts: ``name`` (a bench method, ``fly@15``),
    ``mode`` and ``drafter`` as :class:`~flyspec.config.DecodeConfig` names them, whether the
    prompts carried a prediction, and each request's rounds."""

    name: str
    mode: str
    drafter: str
    prediction: bool
    requests: tuple[TracedRequest, ...]

    @property
    def rounds(self) -> int:
        return sum(len(r.rounds) for r in self.requests)

    @property
    def tau(self) -> float:
        """Tokens committed per round."""
        return sum(r.tokens for r in self.requests) / max(1, self.rounds)

    @property
    def max_block(self) -> int:
        return max((x.drafted for r in self.requests for x in r.rounds), default=0)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "mode": self.mode,
            "drafter": self.drafter,
            "prediction": self.prediction,
            "tau": round(self.tau, 3),
            "requests": [
                {
                    "prompt_tokens": request.prompt_tokens,
                    "rounds": [[r.drafted, r.kept, r.source] for r in request.rounds],
                }
                for request in self.requests
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> Trace:
        try:
            requests = tuple(
                TracedRequest(
                    prompt_tokens=int(request["prompt_tokens"]),
                    rounds=tuple(
                        TracedRound(int(drafted), int(kept), source)
                        for drafted, kept, source in request["rounds"]
                    ),
                )
                for request in data["requests"]
            )
            return cls(
                name=str(data["name"]),
                mode=str(data["mode"]),
                drafter=str(data["drafter"]),
                prediction=bool(data["prediction"]),
                requests=requests,
            )
        except (KeyError, TypeError, ValueError) as error:
            raise FlyspecError(f"not a trace: {error!r}") from error


def traced_request(stats: RequestStats) -> TracedRequest:
    """The trace of one finished request. Deferred windows (``FlyConfig.defer``) are refused:
    their rounds commit across two blocks, which a replay does not model."""
    if any(r.deferred or r.decided is not None for r in stats.rounds):
        raise FlyspecError("a request with deferred windows cannot be traced: record without defer")
    rounds = tuple(
        TracedRound(r.drafted, r.accepted + r.loosely_accepted, r.source) for r in stats.rounds
    )
    return TracedRequest(prompt_tokens=stats.prompt_tokens, rounds=rounds)


def save_traces(path: Path, traces: Sequence[Trace], *, recorded: Mapping) -> None:
    """Write ``traces`` with how they were ``recorded`` (date, commit, machine, command)."""
    document = {
        "format": TRACE_FORMAT,
        "recorded": dict(recorded),
        "traces": [t.as_dict() for t in traces],
    }
    path.write_text(json.dumps(document, indent=1) + "\n")


def load_traces(path: Path) -> tuple[dict, list[Trace]]:
    """How the traces of ``path`` were recorded, and the traces."""
    try:
        document = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise FlyspecError(f"cannot read the traces in {path}: {error}") from error
    if document.get("format") != TRACE_FORMAT:
        raise FlyspecError(f"{path} is not a trace file of format {TRACE_FORMAT}")
    return document.get("recorded", {}), [Trace.from_dict(t) for t in document["traces"]]


@dataclass(frozen=True)
class _Planned:
    kept: int
    next_token: int


class ReplayDrafter(Drafter):
    """Proposes a traced request's blocks, round by round, on the ``reference`` tokens (the
    target's greedy answer after a prompt of ``prompt_length`` tokens): the kept positions
    propose the reference's tokens, the others a wrong one. ``paying``: a drafter per source
    whose cost the round pays (it drafts the block, and its tokens are dropped): the method's
    model drafter for ``model`` rounds, prompt lookup for ``lookup`` rounds; a prediction's
    blocks cost nothing. ``device``: where the target runs; the reference is copied there
    once and the blocks are made from that copy, as a real drafter's are made on the device
    (none: each block is copied from the host)."""

    def __init__(
        self,
        request: TracedRequest,
        reference: Sequence[int],
        *,
        prompt_length: int,
        vocab_size: int,
        paying: Mapping[str, Drafter],
        device: torch.device | None = None,
    ) -> None:
        if len(reference) < request.tokens:
            raise FlyspecError(f"the reference holds {len(reference)} tokens, not {request.tokens}")
        self.request = request
        self.reference = list(reference)
        self.on_device = None if device is None else DeviceTokens(reference, device=device)
        self.prompt_length = prompt_length
        self.vocab_size = vocab_size
        self.paying = dict(paying)
        self.index = 0
        self.planned: _Planned | None = None

    def reset(self) -> None:
        self.index = 0
        self.planned = None
        for drafter in self.paying.values():
            drafter.reset()

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if self.index >= len(self.request.rounds):
            raise FlyspecError("the replay ran past its trace's last round")
        traced = self.request.rounds[self.index]
        self.index += 1
        drafted = min(traced.drafted, k)
        kept = min(traced.kept, drafted)
        payer = self.paying.get(traced.source) if traced.source else None
        paid = payer.propose(context, drafted) if payer is not None and drafted else None
        at = len(context) - self.prompt_length
        if list(context[self.prompt_length :]) != self.reference[:at]:
            raise FlyspecError(f"the replay left its reference before token {at}")
        right = self.reference[at : at + kept]
        wrong = (self.reference[at + kept] + 1) % self.vocab_size
        self.planned = _Planned(kept=kept, next_token=self.reference[at + kept])
        ids = right + [wrong] * (drafted - kept)
        if self.on_device is None:
            tokens = torch.tensor(ids, dtype=torch.long)
        else:  # the same tokens, made on the device from its copy of the reference
            following = self.on_device.span(at + kept, at + kept + 1)
            wrong_tokens = ((following + 1) % self.vocab_size).expand(drafted - kept)
            tokens = torch.cat((self.on_device.span(at, at + kept), wrong_tokens))
        if paid is not None and paid.unread:
            # As the paid block would be: left on the device for the verdict to read, whose
            # ids then settle the draft model's record (its cache is cropped as often).
            tokens = tokens.to(paid.tokens.device)
            return Draft(tokens=tokens, source="model", unread=True, settle=paid.settle)
        return Draft(tokens=tokens, source=traced.source or "model", ids=tuple(ids))

    def take_plan(self) -> _Planned | None:
        """The decision planned for the block just proposed (None once taken)."""
        planned, self.planned = self.planned, None
        return planned


@dataclass
class ReplayCounts:
    """What a replay did: rounds whose real verdict kept as the trace says (``agreed``) or not
    (``overruled``: the target's greedy tokens flipped between forwards of different sizes)."""

    agreed: int = 0
    overruled: int = 0


class ReplayDecoder(SpeculativeDecoder):
    """The decoder whose rounds keep what a trace says: every draft, forward and verification
    runs, and the round's verdict is then the trace's (its kept count, the reference's next
    token). The real verdict is counted against it (:class:`ReplayCounts`)."""

    _replaying: ReplayDrafter | None = None

    @functools.cached_property
    def counts(self) -> ReplayCounts:
        """The replayed rounds' real verdicts against the trace's, over every replay."""
        return ReplayCounts()

    def paying_drafters(self, trace: Trace, config: DecodeConfig) -> dict[str, Drafter]:
        """The drafters whose cost ``trace``'s rounds pay on these models: its method's draft
        model drafter (model or MLA, where the decoder has a draft model) and prompt lookup."""
        paying: dict[str, Drafter] = {
            "lookup": NgramDrafter(max_ngram=config.max_ngram, end_tokens=self.eos_token_ids)
        }
        if any(r.source == "model" for q in trace.requests for r in q.rounds):
            if self.draft is None:
                raise FlyspecError(f"trace {trace.name} drafts with a model: give a draft model")
            paying["model"] = make_drafter(
                config.with_updates(mode="spd", drafter=trace.drafter),
                draft_lm=self.draft,
                end_tokens=self.eos_token_ids,
            )
        return paying

    def replay(
        self,
        prompt_ids: Sequence[int],
        request: TracedRequest,
        reference: Sequence[int],
        config: DecodeConfig,
        *,
        paying: Mapping[str, Drafter],
        stats: RequestStats | None = None,
    ) -> Iterator[TokenEvent]:
        """Run ``request``'s rounds after ``prompt_ids`` (mode and K from ``config``; the
        budget is the trace's tokens), yielding the committed tokens: ``reference``'s."""
        self._replaying = ReplayDrafter(
            request,
            reference,
            prompt_length=len(prompt_ids),
            vocab_size=self.vocab_size,
            paying=paying,
            device=self.target.device,
        )
        # A budget the last round fits whole (a real one may have ended at an end token);
        # the replay stops once that round's tokens are out.
        last = request.rounds[-1] if request.rounds else TracedRound(0, 0, None)
        config = config.with_updates(
            k=max(1, max((r.drafted for r in request.rounds), default=1)),
            auto_k=False,
            max_new_tokens=request.tokens + last.drafted - last.kept,
        )
        events = self.stream(prompt_ids, config, stats=stats, drafter=self._replaying)
        try:
            for produced, event in enumerate(events, start=1):
                yield event
                if produced == request.tokens:
                    break
        finally:
            events.close()
            self._replaying = None

    def _verify(
        self,
        draft: Draft,
        target_logits: torch.Tensor,
        config: DecodeConfig,
        generator: torch.Generator | None,
    ) -> Verdict:
        verdict = super()._verify(draft, target_logits, config, generator)
        planned = None if self._replaying is None else self._replaying.take_plan()
        if planned is None:
            return verdict
        if (
            verdict.num_kept == planned.kept
            and verdict.next_token == planned.next_token
            and not verdict.loose_positions
            and verdict.deferral is None
        ):
            self.counts.agreed += 1
            return verdict
        self.counts.overruled += 1
        return Verdict(
            num_drafted=len(draft),
            num_kept=planned.kept,
            loose_positions=(),
            next_token=planned.next_token,
            draft_ids=verdict.draft_ids,
        )
