"""Per-pair calibration of FLy's rule: the loosest settings that keep a given share of the
target's accuracy on a calibration split, saved with the pair and used as its defaults.

How loose FLy can be without losing accuracy depends on the pair (docs/rules.md: a draft only
3x smaller than its target needs a stricter rule than the paper's 8B/70B pairs).
``flyspec calibrate`` evaluates a grid of FLy settings against the target alone, keeps those
whose recovery (score / target score) is at least ``min_recovery`` on every task, and saves
the one with the most tokens per round (:func:`choose`). Commands that take FLy's options
then start from the saved rule for that pair; an option given on the command line still wins.

A calibration is a JSON file under ``$FLYSPEC_HOME/calibration/``, named by a hash of the
two models' identities (:func:`flyspec.models.identity.model_identity`): a changed weight or
tokenizer file makes another pair, with no calibration.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from flyspec.config import ConfigError, FlyConfig
from flyspec.errors import FlyspecError
from flyspec.models.identity import model_identity
from flyspec.support.atomic_files import write_text_atomically
from flyspec.support.home import flyspec_home

CALIBRATION_FORMAT = 1


@dataclass(frozen=True)
class Candidate:
    """One FLy rule as measured on the calibration split: its recovery in percent per task
    (None where the target scored nothing) and its tokens per round (mean over the tasks)."""

    fly: FlyConfig
    recovery: Mapping[str, float | None]
    tau: float | None

    def keeps(self, min_recovery: float) -> bool:
        """Whether it keeps at least ``min_recovery`` percent on every task."""
        values = list(self.recovery.values())
        return bool(values) and all(v is not None and v >= min_recovery for v in values)


def choose(candidates: Sequence[Candidate], *, min_recovery: float) -> Candidate | None:
    """The candidate with the most tokens per round among those that keep at least
    ``min_recovery`` percent of the target's score on every task (the first on a tie);
    None when none does."""
    kept = [c for c in candidates if c.keeps(min_recovery) and c.tau is not None]
    return max(kept, key=lambda c: c.tau, default=None)


@dataclass(frozen=True)
class Calibration:
    """A pair's calibrated FLy rule and the evidence for it."""

    fly: FlyConfig
    min_recovery: float
    recovery: Mapping[str, float | None]
    tau: float | None
    problems: Mapping[str, Sequence[int]]  # task -> [first, end) of the calibration split
    created: str
    command: str

    def as_dict(self) -> dict:
        return {
            "format": CALIBRATION_FORMAT,
            "fly": dataclasses.asdict(self.fly),
            "min_recovery": self.min_recovery,
            "recovery": dict(self.recovery),
            "tau": self.tau,
            "problems": {task: list(span) for task, span in self.problems.items()},
            "created": self.created,
            "command": self.command,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> Calibration:
        if data.get("format") != CALIBRATION_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {CALIBRATION_FORMAT}")
        return cls(
            fly=FlyConfig(**data["fly"]),
            min_recovery=float(data["min_recovery"]),
            recovery=dict(data["recovery"]),
            tau=data["tau"],
            problems={task: list(span) for task, span in data["problems"].items()},
            created=str(data["created"]),
            command=str(data["command"]),
        )

    def describe(self) -> str:
        """One line: the rule and what it kept, e.g. for the commands that use it."""
        kept = ", ".join(
            f"{task} {first}-{end - 1} {_percent(self.recovery.get(task))}"
            for task, (first, end) in self.problems.items()
        )
        return f"{fly_settings(self.fly)} (kept {kept} of the target's score)"


def fly_settings(fly: FlyConfig) -> str:
    """The rule as command-line options, e.g. ``--theta 1 --window 4 --min-ratio 0.1``."""
    parts = [f"--theta {fly.theta:g}", f"--window {fly.window}"]
    if fly.min_ratio > 0:
        parts.append(f"--min-ratio {fly.min_ratio:g}")
    if fly.max_rank > 0:
        parts.append(f"--max-rank {fly.max_rank}")
    if fly.max_draft_confidence < 1:
        parts.append(f"--max-draft-confidence {fly.max_draft_confidence:g}")
    if fly.defer:
        parts.append("--defer")
    return " ".join(parts)


def calibration_path(target: str, draft: str, *, home: Path | None = None) -> Path:
    """Where the calibration of the pair (``target``, ``draft``: folders, files or hub ids)
    is kept."""
    identity = {"target": model_identity(str(target)), "draft": model_identity(str(draft))}
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    key = hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]
    return flyspec_home(home) / "calibration" / f"{key}.json"


def save_calibration(calibration: Calibration, path: Path) -> None:
    """Write ``calibration`` to ``path`` atomically (a temporary file renamed into place)."""
    write_text_atomically(path, json.dumps(calibration.as_dict(), indent=2) + "\n")


def load_calibration(path: Path) -> Calibration | None:
    """The calibration saved at ``path``, None when there is none; FlyspecError when the
    file cannot be read as one (it says how to fix it)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as error:
        raise FlyspecError(f"cannot read the calibration {path}: {error}") from None
    try:
        return Calibration.from_dict(json.loads(text))
    except (ValueError, KeyError, TypeError, ConfigError) as error:
        raise FlyspecError(
            f"the calibration {path} is damaged ({error}): delete it, or run "
            "`flyspec calibrate` again"
        ) from None


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}%"
