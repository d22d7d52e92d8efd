"""Where the compiled forward's greedy tokens leave the eager forward's, and why: a random
model of a real shape decodes greedily on the lean forward, on the compiled forward, and on the
compiled forward with inductor rounding every intermediate to the model's dtype as eager
torch does (``torch._inductor.config.emulate_precision_casts``). For each, the first token
that differs from eager and the eager target's top-2 logit margin there::

    python benchmarks/compiled_rounding.py --dtype bfloat16 --device cpu --model 0.5b
    python benchmarks/compiled_rounding.py --dtype float32 --device cuda --model 1.5b

Compiled in bfloat16, inductor keeps fused intermediates (norms, rotary embedding, the
residual sums) in float32 where eager torch rounds each to bfloat16, so the logits differ by
bfloat16 rounding, and random weights give near ties that such a difference flips. Where
emulating eager's rounding brings the compiled tokens back to eager's, that is the cause.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS.parent / "src"))

from first_look.models import MODELS, build_model, load_config, random_prompt  # noqa: E402

from flyspec.config import DecodeConfig  # noqa: E402
from flyspec.decoding.loop import SpeculativeDecoder  # noqa: E402
from flyspec.models.cache import CachedLM, common_prefix_length  # noqa: E402


def decode(model: torch.nn.Module, prompt: list[int], tokens: int, forward_path: str) -> list[int]:
    decoder = SpeculativeDecoder(model, forward_path=forward_path)
    config = DecodeConfig(mode="target", max_new_tokens=tokens)
    return [event.token for event in decoder.stream(prompt, config)]


def margins(model: torch.nn.Module, prompt: list[int], answer: list[int]) -> list[float]:
    """The eager model's top-2 logit margin at each token of ``answer``."""
    lm = CachedLM(model, forward_path="lean")
    found = []
    for index in range(len(answer)):
        top = lm.logits(prompt + answer[:index], 1)[0].float().topk(2).values
        found.append(float(top[0] - top[1]))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="0.5b", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompt", type=int, default=64, help="prompt length")
    parser.add_argument("--layers", type=int, help="keep only this many layers (faster)")
    args = parser.parse_args(argv)
    config = load_config(args.model, shapes="real")
    if args.layers:
        config.num_hidden_layers = args.layers
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = build_model(config, device=device, dtype=dtype, seed=1)
    prompt = random_prompt(config.vocab_size, args.prompt)
    print(
        f"{args.model} shape, {config.num_hidden_layers} layers, {args.dtype} on {device}, "
        f"torch {torch.__version__}: {args.tokens} greedy tokens after {args.prompt} random ones"
    )
    eager = decode(model, prompt, args.tokens, "lean")
    eager_margins = margins(model, prompt, eager)
    ties = [i + 1 for i, m in enumerate(eager_margins) if m == 0]
    print(
        f"eager: {len(ties)} of its {len(eager)} tokens are exact ties of the two most likely "
        f"(tokens {', '.join(map(str, ties)) or 'none'}); smallest margin otherwise "
        f"{min((m for m in eager_margins if m > 0), default=float('nan')):.3g}"
    )
    for label, emulate in (("compiled", False), ("compiled, eager's rounding emulated", True)):
        torch._dynamo.reset()
        started = time.perf_counter()
        with torch._inductor.config.patch(emulate_precision_casts=emulate):
            compiled = decode(model, prompt, args.tokens, "compiled")
        same = common_prefix_length(compiled, eager)
        if compiled == eager:
            verdict = f"the same {len(eager)} tokens as eager"
        else:
            margin = eager_margins[same]
            verdict = f"leaves eager at token {same + 1}, eager's top-2 margin there {margin:.3g}"
        print(f"{label}: {verdict} ({time.perf_counter() - started:.0f} s with compiling)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(BENCHMARKS))
    sys.exit(main())
