"""The same edit request sent twice to ``flyspec serve``: each one's time to first token, with
the prompt cache (``--cache-prompt``, the default: the second reads only what it does not
share with the first) and without it (``--no-cache-prompt``)::

    .venv/bin/python benchmarks/prompt_cache_ttft.py [--backend llamacpp|torch]

The request is the first humaneval-edit problem (chat, its code as the ``prediction``), 16 new
tokens at most, streamed through the ``openai`` client; each server is started as a child on a
free port and stopped after. About a minute on 2 cores with llama.cpp.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from served import serving  # noqa: E402

from flyspec.bench.prompts import dataset_prompts  # noqa: E402


def time_to_first_token(client, prompt) -> float:
    """Seconds from sending the streamed request to its first content."""
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model="flyspec",
        messages=list(prompt.messages),
        prediction={"type": "content", "content": prompt.prediction},
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
    return first


def main() -> int:
    import openai

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="llamacpp", choices=("llamacpp", "torch"))
    args = parser.parse_args()
    (prompt,) = dataset_prompts("humaneval-edit", limit=1, chat=True)
    arguments = ["--backend", args.backend, "--served-model-name", "flyspec"]
    arguments += ["--mode", "spd", "--drafter", "ngram"]
    for cache in ("--cache-prompt", "--no-cache-prompt"):
        with serving([*arguments, cache], start_seconds=300) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300)
            first, second = (time_to_first_token(client, prompt) for _ in range(2))
            print(f"{cache}: time to first token {first:.2f} s, then {second:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
