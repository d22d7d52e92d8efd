"""``flyspec serve``: the OpenAI-compatible server of :mod:`flyspec.server`, or vLLM's with the
FLy plugin. Only argparse at import time: fastapi, uvicorn and torch are imported when the
command runs, so ``flyspec --help`` stays fast."""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from flyspec.cli.options import (
    add_backend_arguments,
    add_decode_arguments,
    add_model_arguments,
    add_option,
    add_vllm_arguments,
    decode_config_from_args,
    load_engine,
    vllm_engine_spec,
)
from flyspec.errors import FlyspecError
from flyspec.models.prompt_cache import DEFAULT_CACHE_BYTES
from flyspec.server.access import (
    API_KEY_ENV,
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_PORT,
    DEFAULT_QUEUE_SIZE,
    DEFAULT_REQUEST_TIMEOUT,
    GRACEFUL_SHUTDOWN_SECONDS,
    default_model_name,
    exposure_warning,
    resolve_api_key,
)


def add_parser(commands) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``flyspec`` subcommands (an argparse subparsers object)."""
    serve = commands.add_parser(
        "serve",
        help="serve the model pair over an OpenAI-compatible HTTP API",
        description=(
            "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, "
            "/health, /metrics). The decoding options below are the defaults of requests that "
            "do not set mode, drafter, k, window, theta, temperature, ... themselves; "
            "--max-tokens is the default max_tokens."
        ),
    )
    model = add_model_arguments(serve)
    model.add_argument(
        "--no-draft",
        action="store_true",
        help="do not load the draft model (only mode 'target' and the ngram drafter then work)",
    )
    server = serve.add_argument_group("server")
    server.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default 127.0.0.1)")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default 8000)")
    add_option(
        server,
        "--served-model-name",
        aliases=("--model-name",),
        dest="model_name",
        metavar="NAME",
        help="model id served in /v1/models (default: the target's name)",
    )
    server.add_argument(
        "--cache-prompt",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the models' caches between requests, so that a request reads only the part "
        "of its prompt not shared with the request before (default: on; a request's tokens "
        "may then differ by rounding from a fresh run's, as in llama-server)",
    )
    server.add_argument(
        "--cache-ram",
        type=int,
        default=DEFAULT_CACHE_BYTES // 2**20,
        metavar="MIB",
        help="with --cache-prompt, keep the models' states of recent requests in this much host "
        "memory, restored when a prompt comes back (by longest common prefix, as "
        "llama-server's --cache-ram; default: %(default)s MiB; 0: the last request only)",
    )
    server.add_argument(
        "--first-token-alone",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a streamed request's first round is the target's alone, so that its first token "
        "comes after one forward instead of after a drafted and verified block (default: on; "
        "the same tokens in the exact modes, in FLy the first token is the target's own)",
    )
    server.add_argument(
        "--queue-size",
        type=int,
        default=DEFAULT_QUEUE_SIZE,
        help="requests that may wait while one generates; more are answered 429 (default 8)",
    )
    server.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT,
        help="seconds from arrival (waiting included) after which a generation is stopped and "
        "answered with finish_reason 'length' (default 600)",
    )
    server.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on every /v1 route (401 otherwise); "
        f"default: the {API_KEY_ENV} environment variable, which keeps the key out of the "
        "process list; no key when neither is set",
    )
    server.add_argument(
        "--metrics-require-key",
        action="store_true",
        help="require the API key on /metrics too (default: /metrics is open, like /health)",
    )
    server.add_argument(
        "--docs",
        action="store_true",
        help="serve /docs, /redoc and /openapi.json (default: off; they are open to anyone "
        "even with an API key)",
    )
    server.add_argument(
        "--max-body-bytes",
        type=byte_size,
        metavar="SIZE",
        help="largest request body; bigger ones are answered 413. A byte count, or with a "
        "K, M or G suffix (KiB, MiB, GiB) (default 4M)",
    )
    server.add_argument(
        "--max-messages",
        type=int,
        metavar="N",
        help=f"most messages in one chat request; more are answered 400 "
        f"(default {DEFAULT_MAX_MESSAGES})",
    )
    server.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn log level (default info)",
    )
    add_decode_arguments(serve)
    add_backend_arguments(serve)
    vllm = add_vllm_arguments(serve)
    vllm.add_argument(
        "--vllm-args",
        default="",
        help="further arguments for `vllm serve`, as one quoted string (--engine vllm)",
    )
    vllm.add_argument(
        "--dry-run",
        action="store_true",
        help="print the vLLM server command (with the environment it sets) and start nothing "
        "(--engine vllm)",
    )
    serve.set_defaults(handler=run_serve)
    return serve


def run_serve(args: argparse.Namespace) -> int:
    """Load the models and serve until interrupted."""
    defaults = decode_config_from_args(args).with_updates(
        first_token_alone=args.first_token_alone  # streamed requests only (request_config)
    )
    if not 0 <= args.port <= 65535:
        raise FlyspecError(f"--port must be in 0..65535, got {args.port}")
    if args.no_draft and defaults.uses_draft_model:
        raise FlyspecError(
            f"--no-draft cannot serve the default mode {defaults.mode!r} with the "
            f"{defaults.drafter!r} drafter; add --mode target or --drafter ngram"
        )
    api_key = resolve_api_key(args.api_key, environ=os.environ)
    if args.dry_run and args.engine != "vllm":
        raise FlyspecError("--dry-run prints the command of a vLLM server: add --engine vllm")
    if args.engine == "vllm":
        refuse_flyspec_server_options(args, api_key=api_key)
        return run_vllm_serve(args, defaults)
    if args.queue_size < 0:
        raise FlyspecError(f"--queue-size must be >= 0, got {args.queue_size}")
    if args.cache_ram < 0:
        raise FlyspecError(f"--cache-ram must be >= 0 MiB, got {args.cache_ram}")
    if not args.request_timeout > 0:
        raise FlyspecError(f"--request-timeout must be > 0, got {args.request_timeout}")
    options = server_options(args, api_key=api_key)

    try:
        import uvicorn

        from flyspec.server.app import create_app
        from flyspec.server.scheduler import engine_thread
    except ImportError as error:
        raise FlyspecError(
            f"flyspec serve needs the 'serve' extra ({error.name} is missing): "
            "pip install 'flyspec[serve]'"
        ) from None

    # The models load on the thread that will run every generation (engine_thread says why).
    engine_executor = engine_thread()
    engine = engine_executor.submit(load_engine, args, with_draft=not args.no_draft).result()
    engine.decoder.reuse_prefix = args.cache_prompt  # SpeculativeDecoder says what it costs
    if args.cache_prompt:
        engine.decoder.keep_prompts(args.cache_ram * 2**20)
    app = create_app(
        engine,
        defaults=defaults,
        model_name=args.model_name or default_model_name(args.target, engine.target_name),
        queue_size=args.queue_size,
        request_timeout=args.request_timeout,
        engine_executor=engine_executor,
        **options,
    )
    warning = exposure_warning(args.host, api_key=api_key)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )
    return 0


def server_options(args: argparse.Namespace, *, api_key: str | None) -> dict[str, Any]:
    """``create_app``'s access and size settings from the serve options, checked
    (FlyspecError): ``api_key``, ``metrics_require_key``, ``docs``, ``max_body_bytes`` and
    ``max_messages``, the last two with their defaults filled in."""
    max_messages = DEFAULT_MAX_MESSAGES if args.max_messages is None else args.max_messages
    if max_messages < 1:
        raise FlyspecError(f"--max-messages must be >= 1, got {max_messages}")
    if args.metrics_require_key and api_key is None:
        raise FlyspecError(f"--metrics-require-key needs --api-key or {API_KEY_ENV}")
    return {
        "api_key": api_key,
        "metrics_require_key": args.metrics_require_key,
        "docs": args.docs,
        "max_body_bytes": args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
        "max_messages": max_messages,
    }


def byte_size(text: str) -> int:
    """argparse type: a positive byte count, optionally with a K, M or G suffix (powers of
    1024; ``4M``, ``4MiB`` and ``4MB`` are all 4 MiB)."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:([kmg])(?:i?b)?|b)?\s*", text, flags=re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4194304, 512K or 4M)")
    power = {None: 0, "k": 1, "m": 2, "g": 3}[match.group(2) and match.group(2).lower()]
    size = int(match.group(1)) * 1024**power
    if size < 1:
        raise argparse.ArgumentTypeError(f"the size must be at least 1 byte, got {text!r}")
    return size


def refuse_flyspec_server_options(args: argparse.Namespace, *, api_key: str | None) -> None:
    """``--engine vllm`` runs vLLM's own server: refuse the options only flyspec's has, so an
    API key is never silently dropped."""
    if api_key is not None:
        raise FlyspecError(
            f"--api-key / {API_KEY_ENV} is not passed on to vLLM's server; give vLLM its own "
            "key (VLLM_API_KEY, or --vllm-args '--api-key ...')"
        )
    given = [
        flag
        for flag, value in (
            ("--metrics-require-key", args.metrics_require_key),
            ("--docs", args.docs),
            ("--max-body-bytes", args.max_body_bytes),
            ("--max-messages", args.max_messages),
        )
        if value not in (None, False)
    ]
    if given:
        raise FlyspecError(f"{', '.join(given)}: only for flyspec's own server, not --engine vllm")


def run_vllm_serve(args: argparse.Namespace, defaults) -> int:
    """Replace this process with vLLM's OpenAI server, FLy plugin on in ``fly`` mode. The
    decoding flags map onto vLLM's: mode and drafter onto the speculative config, K onto
    num_speculative_tokens, W/theta/entropy onto the plugin's settings, and temperature,
    top-k, top-p and --max-tokens onto the requests' defaults."""
    import shlex

    from flyspec.integrations.vllm.launch import (
        engine_environment,
        exec_serve,
        printable,
        serve_command,
    )
    from flyspec.integrations.vllm.predictions import MIDDLEWARE

    if defaults.stop or defaults.draft_temperature or defaults.draft_confidence:
        raise FlyspecError(
            "--stop, --draft-temperature and --draft-confidence are not mapped onto vLLM "
            "(send stop strings with each request)"
        )
    if defaults.loosen_predicted:
        raise FlyspecError("--loosen-predicted: vLLM has no Predicted Outputs")
    if defaults.sampling.penalised:
        raise FlyspecError(
            "--presence-penalty, --frequency-penalty and --repetition-penalty are not mapped "
            "onto vLLM (send them with each request)"
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
        # vLLM has no Predicted Outputs: a request with a prediction gets a clear 400.
        extra_arguments=[*extra, "--middleware", MIDDLEWARE, "--uvicorn-log-level", args.log_level],
    )
    if args.dry_run:
        print(printable(command, environment=engine_environment(os.environ)), flush=True)
        return 0
    print(f"flyspec: starting {printable(command)}", flush=True)
    exec_serve(command)
    return 0  # pragma: no cover - exec does not return
