"""Where ``-k auto``'s measured forward costs are kept between processes: one JSON file per
machine and set of models, under ``$FLYSPEC_HOME/forward-costs``."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from flyspec.decoding.auto_k.policy import ForwardCosts
from flyspec.support.atomic_files import write_text_atomically
from flyspec.support.home import flyspec_home
from flyspec.support.machine import cpu_identity


@dataclass(frozen=True)
class CostStore:
    """The file ``path`` holding the target's forward costs and the draft model's seconds per
    token, as :func:`~flyspec.decoding.auto_k.measure.measure_costs` measured them."""

    path: Path

    def load(self) -> tuple[ForwardCosts | None, float]:
        """The kept costs and draft seconds per token; ``(None, 0.0)`` where there are none
        (no file, or a damaged one: measured anew)."""
        try:
            kept = json.loads(self.path.read_text())
            seconds = {int(n): float(s) for n, s in kept["seconds"].items()}
            draft_seconds = float(kept.get("draft_token_seconds", 0.0))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None, 0.0
        return (ForwardCosts(seconds) if seconds else None), draft_seconds

    def save(self, costs: ForwardCosts | None, draft_token_seconds: float) -> None:
        seconds = {} if costs is None else costs.seconds
        kept = {"seconds": seconds, "draft_token_seconds": draft_token_seconds}
        write_text_atomically(self.path, json.dumps(kept, indent=1) + "\n")


def costs_store(identity: Mapping, home: Path | None = None) -> CostStore:
    """Where ``-k auto``'s measured costs are kept for the machine and the models that
    ``identity`` names (whatever the forwards' speed depends on: the models and their
    kernels, the backend and its threads); this machine's CPU, torch and GPU are added here.
    Under ``$FLYSPEC_HOME/forward-costs``."""
    cpu, flags = cpu_identity()
    machine = {
        "cpu": cpu,
        "flags": flags,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
    }
    text = json.dumps({"models": identity, "machine": machine}, sort_keys=True, default=str)
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    return CostStore(flyspec_home(home) / "forward-costs" / f"{key}.json")
