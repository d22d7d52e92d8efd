"""Who may use the server and how much one request may carry: the defaults of
``flyspec serve``'s limits, the API key and the warning for a server open beyond this machine."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from pathlib import Path

from flyspec.errors import FlyspecError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_QUEUE_SIZE = 8
DEFAULT_REQUEST_TIMEOUT = 600.0
# The default pair's context is 32,768 tokens: a prompt that fills it is 512 KiB of JSON even
# at 16 bytes a token, and a longer one is refused (400) after tokenizing anyway. 4 MiB leaves
# room for longer-context models and heavy escaping while bounding what one request costs.
DEFAULT_MAX_BODY_BYTES = 4 * 1024**2
# A ChatML message costs at least 5 template tokens, so 4096 messages take 20,480 or more of
# a 32,768-token context: a conversation with more rarely fits.
DEFAULT_MAX_MESSAGES = 4096
API_KEY_ENV = "FLYSPEC_API_KEY"
GRACEFUL_SHUTDOWN_SECONDS = 5  # on Ctrl-C, streams still open after this are cut


def resolve_api_key(option: str | None, *, environ: Mapping[str, str]) -> str | None:
    """The API key: ``--api-key``, else the ``FLYSPEC_API_KEY`` variable of ``environ``
    (an empty variable counts as unset); None when neither gives one. Surrounding
    whitespace is dropped: an HTTP header cannot carry it."""
    if option is not None:
        if not option.strip():
            raise FlyspecError("--api-key must not be empty")
        return option.strip()
    return environ.get(API_KEY_ENV, "").strip() or None


def is_loopback(host: str) -> bool:
    """True when ``host`` only listens on this machine (localhost, 127.0.0.0/8, ::1)."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, *, api_key: str | None) -> str | None:
    """The warning printed when the server listens beyond loopback without an API key."""
    if api_key is not None or is_loopback(host):
        return None
    return (
        f"flyspec: warning: listening on {host!r}, beyond this machine, without an API key: "
        f"anyone who reaches the port can use the model; set {API_KEY_ENV} (or --api-key), "
        "or bind --host 127.0.0.1"
    )


def default_model_name(target_arg: str | None, target_path: str) -> str:
    """The served id: a hub id as given, else the folder name (or GGUF file stem)."""
    if target_arg and not Path(target_arg).exists():
        return target_arg
    path = Path(target_path)
    return path.stem if path.suffix.lower() == ".gguf" else path.name
