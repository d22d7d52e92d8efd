"""``flyspec generate``: one prompt, streamed, with the statistics of the round."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from flyspec import config as cfg
from flyspec.cli.options import (
    add_backend_arguments,
    add_chat_argument,
    add_decode_arguments,
    add_model_arguments,
    decode_config_from_args,
    load_engine,
    say,
)
from flyspec.errors import FlyspecError
from flyspec.support.resident_memory import peak_rss_bytes

ORIGIN_COLOURS = {
    "exact": "\033[32m",  # green
    "loose": "\033[33m",  # yellow
    "correction": "\033[31m",  # red
    "bonus": "\033[36m",  # cyan
}
RESET = "\033[0m"


def add_parser(commands) -> argparse.ArgumentParser:
    """Add ``generate`` to the ``flyspec`` subcommands."""
    generate = commands.add_parser(
        "generate", help="generate text for one prompt, streamed, with statistics"
    )
    generate.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    add_model_arguments(generate)
    prompt = generate.add_argument_group("prompt")
    add_chat_argument(
        prompt,
        default=None,
        help="wrap the prompt in the tokenizer's chat template (default: when it has one)",
    )
    prompt.add_argument(
        "--prediction",
        metavar="FILE",
        help="a file holding text the answer is expected to largely repeat, such as the code "
        "being edited ('-' reads standard input): drafts come from it first (Predicted Outputs)",
    )
    answer = prompt.add_mutually_exclusive_group()
    answer.add_argument(
        "--json-schema",
        metavar="FILE",
        help="a file holding a JSON schema: the answer is JSON that follows it (structured "
        "outputs: the target's and the draft's tokens masked by its grammar)",
    )
    answer.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    add_decode_arguments(generate)
    output = generate.add_argument_group("output")
    shown = output.add_mutually_exclusive_group()
    shown.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with text, token_ids and stats on stdout instead of "
        "streaming the text (as bench --json prints its report instead of the table)",
    )
    shown.add_argument(
        "--show",
        action="store_true",
        help="colour each token by how it was obtained (exact, loose, correction, bonus)",
    )
    # Their comparison with the target alone and llama.cpp is `flyspec bench --prompt`'s now:
    # given, they say so in one line.
    output.add_argument("--compare-target", action="store_true", help=argparse.SUPPRESS)
    output.add_argument("--compare-pairs", metavar="N", help=argparse.SUPPRESS)
    add_backend_arguments(generate)
    generate.set_defaults(handler=run_generate)
    return generate


COMPARISON_MOVED = (
    "timing the method against the target alone and llama.cpp is `flyspec bench --prompt "
    "PROMPT` (--methods names the method, --repeats the alternated runs)"
)


def run_generate(args: argparse.Namespace) -> int:
    if args.compare_target or args.compare_pairs is not None:
        raise FlyspecError(COMPARISON_MOVED)
    config = decode_config_from_args(args)
    prompt, prediction = read_prompt_and_prediction(args.prompt, args.prediction)
    schema = read_schema(args.json_schema) if args.json_schema is not None else None
    wants_json = schema is not None or args.json_object
    engine = load_engine(args, with_draft=config.uses_draft_model)
    grammar = engine.json_grammar(schema) if wants_json else None
    prompt_ids = engine.encode(prompt, chat=args.chat)
    prediction_ids = None if prediction is None else engine.encode_prediction(prediction)
    if args.json:
        result = engine.generate(prompt_ids, config, prediction=prediction_ids, grammar=grammar)
        print(json_result(result))
        return 0
    stream_answer(
        engine, prompt_ids, config, show=args.show, prediction=prediction_ids, grammar=grammar
    )
    return 0


def json_result(result, **figures) -> str:
    """``--json``'s line: the result, ``figures`` beside it, and the peak resident memory of
    this process (models loaded and run)."""
    payload = {**result.as_dict(), **figures, "peak_rss_bytes": peak_rss_bytes()}
    return json.dumps(payload, ensure_ascii=False)


def stream_answer(
    engine,
    prompt_ids: Sequence[int],
    config: cfg.DecodeConfig,
    *,
    label: str | None = None,
    show: bool = False,
    prediction: Sequence[int] | None = None,
    grammar=None,
):
    """Stream the answer on stdout as its tokens are committed (``show``: each coloured by
    how it was obtained), then its statistics on stderr after ``[label]`` (None: the mode),
    and what became of the prediction where there is one; return the statistics."""
    from flyspec.decoding.stats import RequestStats

    stats = RequestStats()
    if show:
        say(
            "colours: "
            + ", ".join(f"{colour}{origin}{RESET}" for origin, colour in ORIGIN_COLOURS.items())
        )
    chunks = engine.stream(prompt_ids, config, stats=stats, prediction=prediction, grammar=grammar)
    for chunk in chunks:
        text = chunk.text
        if show and text:
            text = f"{ORIGIN_COLOURS[chunk.origin]}{text}{RESET}"
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    say(f"[{label or config.mode}] {stats.summary_line()}")
    if prediction is not None:
        say(
            f"prediction: {len(prediction)} tokens; "
            f"{stats.accepted_prediction_tokens} of its drafted tokens kept, "
            f"{stats.rejected_prediction_tokens} rejected"
        )
    return stats


def read_prompt_and_prediction(prompt: str, prediction: str | None) -> tuple[str, str | None]:
    """The prompt's text (FlyspecError where it is empty) and --prediction's, or None: each
    given on the command line or as a file, standard input read for one of them at most."""
    if prompt == "-" and prediction == "-":
        raise FlyspecError("the prompt and --prediction cannot both be read from standard input")
    text = read_prompt(prompt)
    if not text.strip():
        raise FlyspecError("the prompt is empty")
    return text, None if prediction is None else read_prediction(prediction)


def read_prompt(argument: str) -> str:
    """The prompt given on the command line, or standard input's for ``-``, as UTF-8 text
    (FlyspecError naming the first invalid byte otherwise)."""
    source = "standard input" if argument == "-" else "the prompt"
    data = sys.stdin.buffer.read() if argument == "-" else os.fsencode(argument)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FlyspecError(
            f"{source} is not valid UTF-8: byte 0x{data[error.start]:02x} at offset {error.start}"
        ) from None


def read_schema(path: str) -> dict:
    """The JSON schema in the file ``path`` (FlyspecError naming the problem)."""
    try:
        with open(path, encoding="utf-8") as handle:
            schema = json.load(handle)
    except OSError as error:
        raise FlyspecError(f"cannot read the schema file {path}: {error.strerror}") from None
    except ValueError as error:
        raise FlyspecError(f"the schema file {path} is not JSON: {error}") from None
    if not isinstance(schema, dict):
        raise FlyspecError(f"the schema file {path} holds no JSON object (a schema is one)")
    return schema


def read_prediction(argument: str) -> str:
    """The text of ``--prediction``: a UTF-8 file, or standard input for ``-``."""
    if argument == "-":
        data, source = sys.stdin.buffer.read(), "standard input"
    else:
        source = f"the prediction file {argument}"
        try:
            with open(argument, "rb") as handle:
                data = handle.read()
        except OSError as error:
            raise FlyspecError(f"cannot read {source}: {error.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FlyspecError(
            f"{source} is not valid UTF-8: byte 0x{data[error.start]:02x} at offset {error.start}"
        ) from None
    if not text:
        raise FlyspecError(f"{source} is empty: give the text the answer should repeat")
    return text
