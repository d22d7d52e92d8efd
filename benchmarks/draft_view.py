"""The draft model's view of every loosely kept token of a ``flyspec eval`` run: its
probability of its own token (its confidence) and of the target's, next to the outcome of the
token's problem. Loose-token records of runs made before flyspec recorded the draft's
confidence lack it; this recomputes it from the cached generations, so that a rule on it can be
chosen on runs already made::

    .venv/bin/python benchmarks/draft_view.py results/tune-humaneval/eval.json --method fly

The draft model is read in float32 with transformers (flyspec's engine drafts with its int8
form, so the figures can differ from a record made by the engine in the last digits). The
generations' token ids come from the evaluation cache the run used.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flyspec.evaluation.cache import GenerationCache

CAPS = (0.3, 0.5, 0.7, 0.9)


def cached_token_ids(cache: GenerationCache, key: str) -> list[int]:
    entry = cache.get(key)
    if entry is None:
        raise SystemExit(f"draft_view: generation {key} is not in the cache {cache.folder}")
    return entry["token_ids"]


def draft_view(payload: dict, method: str, draft_path: str) -> list[dict]:
    """One row per loose token of ``method``: the record's features plus ``draft_confidence``
    and ``draft_prob_of_target`` (the draft model's probabilities of the two tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flyspec.evaluation.tasks import load_problems, make_task

    tokenizer = AutoTokenizer.from_pretrained(draft_path)
    model = AutoModelForCausalLM.from_pretrained(draft_path, dtype=torch.float32).eval()
    chat = payload["settings"]["prompt_style"] == "chat template"
    cache = GenerationCache(payload["cache"]["dir"])
    samples = {(s["task"], s["problem_id"], s["method"]): s for s in payload["samples"]}
    rows = []
    for task_name, per_method in payload["loosening"].items():
        if method not in per_method:
            continue
        task = make_task(task_name)
        problems = {task.problem_id(p): p for p in load_problems(task_name, None)}
        for record in per_method[method]["tokens"]:
            sample = samples[(task_name, record["problem_id"], method)]
            output = cached_token_ids(cache, sample["cache_key"])
            prompt = task.prompt(problems[record["problem_id"]], chat=chat).token_ids(tokenizer)
            index = record["output_index"]
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([prompt + output[:index]])).logits[0, -1]
            probs = logits.float().softmax(-1)
            rows.append(
                {
                    "task": task_name,
                    **record,
                    "draft_confidence": float(probs[record["draft_token"]]),
                    "draft_prob_of_target": float(probs[record["target_token"]]),
                }
            )
    return rows


def summary(rows: list[dict]) -> list[str]:
    """Per cap on the draft's confidence: the share of loose tokens of each outcome it would
    refuse, and the lost problems all of whose loose tokens it would refuse."""
    lines = ["| cap | refused: lost | unchanged | gained | lost problems fully refused |"]
    lines.append("|---|---|---|---|---|")
    for cap in CAPS:
        cells = []
        for outcome in ("lost", "unchanged", "gained"):
            group = [r for r in rows if r["outcome"] == outcome]
            refused = sum(r["draft_confidence"] > cap for r in group)
            cells.append(f"{refused}/{len(group)}")
        lost = {}
        for r in rows:
            if r["outcome"] == "lost":
                key = (r["task"], r["problem_id"])
                lost[key] = lost.get(key, True) and r["draft_confidence"] > cap
        cells.append(f"{sum(lost.values())}/{len(lost)}")
        lines.append(f"| draft confidence <= {cap:g} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("eval_json", type=Path)
    parser.add_argument("--method", default="fly", help="the FLy method's name (default fly)")
    parser.add_argument("--output", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    payload = json.loads(args.eval_json.read_text(encoding="utf-8"))
    rows = draft_view(payload, args.method, payload["models"]["draft"]["path"])
    if not rows:
        print(f"draft_view: no loose tokens of {args.method!r} in {args.eval_json}")
        return 1
    for r in rows:
        print(
            f"{r['problem_id']:16} {r['outcome'] or '-':9} entropy {r['entropy']:.2f} "
            f"ratio {r['ratio']:.2f} draft confidence {r['draft_confidence']:.2f} "
            f"(target's token {r['draft_prob_of_target']:.2f})"
        )
    print("\n".join(["", *summary(rows)]))
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
