"""The same edit request sent twice, streamed, to llama-server and to ``flyspec serve``: each
one's time to first token. llama-server keeps its prompt cache (its default); flyspec with its
prompt cache (``--cache-prompt``, the default: the second request reads only what it does not
share with the first) and a streamed request's first token alone (``--first-token-alone``,
the default), then without each::

    .venv/bin/python benchmarks/prompt_cache_ttft.py [--backend llamacpp|torch] [--passes N]

The request is the first humaneval-edit problem (chat, its code as flyspec's ``prediction``),
16 new tokens at most, greedy, through the ``openai`` client. Each server runs as a child on a
free port, on the default pair (llama-server on the target's GGUF with the same threads and
context as flyspec's llama.cpp backend). With ``--passes N`` the servers take turns N times,
and each figure is the median. About two minutes a pass on 2 cores with llama.cpp.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from served import llama_serving, serving  # noqa: E402

from flyspec.bench.prompts import dataset_prompts  # noqa: E402

FLYSPEC_SETTINGS = {
    "flyspec serve": [],
    "flyspec serve --no-first-token-alone": ["--no-first-token-alone"],
    "flyspec serve --no-cache-prompt": ["--no-cache-prompt"],
}


def time_to_first_token(client, prompt, *, prediction: bool) -> float:
    """Seconds from sending the streamed request to its first content."""
    extra = {"prediction": {"type": "content", "content": prompt.prediction}} if prediction else {}
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model="flyspec",
        messages=list(prompt.messages),
        max_tokens=16,
        temperature=0,
        stream=True,
        **extra,
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
    return first


def twice(url: str, prompt, *, prediction: bool) -> tuple[float, float]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300)
    first, second = (time_to_first_token(client, prompt, prediction=prediction) for _ in range(2))
    return first, second


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="llamacpp", choices=("llamacpp", "torch"))
    parser.add_argument("--passes", type=int, default=1)
    args = parser.parse_args()
    (prompt,) = dataset_prompts("humaneval-edit", limit=1, chat=True)
    flyspec = ["--backend", args.backend, "--served-model-name", "flyspec"]
    flyspec += ["--mode", "spd", "--drafter", "ngram"]
    times: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.passes):
        with llama_serving() as url:
            times.setdefault("llama-server", []).append(twice(url, prompt, prediction=False))
        for name, extra in FLYSPEC_SETTINGS.items():
            with serving([*flyspec, *extra], start_seconds=300) as url:
                times.setdefault(name, []).append(twice(url, prompt, prediction=True))
    reference = statistics.median(second for _, second in times["llama-server"])
    print(f"time to first token, median of {args.passes} pass(es), the same request sent twice:")
    for name, pairs in times.items():
        first = statistics.median(one for one, _ in pairs)
        second = statistics.median(two for _, two in pairs)
        print(
            f"  {name}: {first:.3f} s, then {second:.3f} s "
            f"({second / reference:.2f}x llama-server's second)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
