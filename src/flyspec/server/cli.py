"""The ``flyspec serve`` subcommand. Only argparse at import time: fastapi, uvicorn and torch
are imported when the command runs, so ``flyspec --help`` stays fast."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_QUEUE_SIZE = 8
DEFAULT_REQUEST_TIMEOUT = 600.0
GRACEFUL_SHUTDOWN_SECONDS = 5  # on Ctrl-C, streams still open after this are cut


def add_parser(commands) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``flyspec`` subcommands (an argparse subparsers object)."""
    from flyspec.cli import add_decode_arguments, add_model_arguments, add_vllm_arguments

    serve = commands.add_parser(
        "serve",
        help="serve the model pair over an OpenAI-compatible HTTP API",
        description=(
            "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, "
            "/health, /metrics). The decoding options below are the defaults of requests that "
            "do not set mode, drafter, k, window, theta, temperature, ... themselves; "
            "--max-new-tokens is the default max_tokens."
        ),
    )
    serve.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default 8000)")
    add_model_arguments(serve)
    serve.add_argument(
        "--no-draft",
        action="store_true",
        help="do not load the draft model (only mode 'target' and the ngram drafter then work)",
    )
    add_decode_arguments(serve)
    serve.add_argument(
        "--queue-size",
        type=int,
        default=DEFAULT_QUEUE_SIZE,
        help="requests that may wait while one generates; more are answered 429 (default 8)",
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT,
        help="seconds from arrival (waiting included) after which a generation is stopped and "
        "answered with finish_reason 'length' (default 600)",
    )
    serve.add_argument(
        "--model-name", help="model id served in /v1/models (default: the target's name)"
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn log level (default info)",
    )
    add_vllm_arguments(serve)
    serve.add_argument(
        "--vllm-args",
        default="",
        help="further arguments for `vllm serve`, as one quoted string (--engine vllm)",
    )
    serve.set_defaults(handler=run_serve)
    return serve


def run_serve(args: argparse.Namespace) -> int:
    """Load the models and serve until interrupted."""
    from flyspec.cli import decode_config_from_args, load_engine
    from flyspec.errors import FlyspecError

    defaults = decode_config_from_args(args)
    if not 0 <= args.port <= 65535:
        raise FlyspecError(f"--port must be in 0..65535, got {args.port}")
    if args.no_draft and defaults.uses_draft_model:
        raise FlyspecError(
            f"--no-draft cannot serve the default mode {defaults.mode!r} with the "
            f"{defaults.drafter!r} drafter; add --mode target or --drafter ngram"
        )
    if args.engine == "vllm":
        return run_vllm_serve(args, defaults)
    if args.queue_size < 0:
        raise FlyspecError(f"--queue-size must be >= 0, got {args.queue_size}")
    if not args.request_timeout > 0:
        raise FlyspecError(f"--request-timeout must be > 0, got {args.request_timeout}")

    try:
        import uvicorn

        from flyspec.server.app import create_app
    except ImportError as error:
        raise FlyspecError(
            f"flyspec serve needs the 'serve' extra ({error.name} is missing): "
            "pip install 'flyspec[serve]'"
        ) from None

    engine = load_engine(args, with_draft=not args.no_draft)
    app = create_app(
        engine,
        defaults=defaults,
        model_name=args.model_name or default_model_name(args.target, engine.target_name),
        queue_size=args.queue_size,
        request_timeout=args.request_timeout,
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )
    return 0


def run_vllm_serve(args: argparse.Namespace, defaults) -> int:
    """Replace this process with vLLM's OpenAI server, FLy plugin on in ``fly`` mode. The
    decoding flags map onto vLLM's: mode and drafter onto the speculative config, K onto
    num_speculative_tokens, W/theta/entropy onto the plugin's settings, and temperature,
    top-k, top-p and --max-new-tokens onto the requests' defaults."""
    import shlex

    from flyspec.cli import vllm_engine_spec
    from flyspec.errors import FlyspecError
    from flyspec.integrations.vllm.launch import exec_serve, printable, serve_command

    if defaults.stop or defaults.draft_temperature or defaults.draft_confidence:
        raise FlyspecError(
            "--stop, --draft-temperature and --draft-confidence are not mapped onto vLLM "
            "(send stop strings with each request)"
        )
    spec = vllm_engine_spec(args, defaults, mode=defaults.mode)
    sampling = defaults.sampling
    generation = {"temperature": sampling.temperature, "max_new_tokens": defaults.max_new_tokens}
    if sampling.top_k:
        generation["top_k"] = sampling.top_k
    if sampling.top_p < 1:
        generation["top_p"] = sampling.top_p
    try:
        extra = shlex.split(args.vllm_args)
    except ValueError as error:
        raise FlyspecError(f"--vllm-args: {error}") from None
    command = serve_command(
        spec,
        host=args.host,
        port=args.port,
        served_model_name=args.model_name or default_model_name(args.target, spec.target),
        generation_defaults=generation,
        extra_arguments=[*extra, "--uvicorn-log-level", args.log_level],
    )
    print(f"flyspec: starting {printable(command)}", flush=True)
    exec_serve(command)
    return 0  # pragma: no cover - exec does not return


def default_model_name(target_arg: str | None, target_path: str) -> str:
    """The served id: a hub id as given, else the folder name (or GGUF file stem)."""
    if target_arg and not Path(target_arg).exists():
        return target_arg
    path = Path(target_path)
    return path.stem if path.suffix.lower() == ".gguf" else path.name
