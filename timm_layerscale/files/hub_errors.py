"""Hub failures as one-line :class:`~timm_layerscale.errors.HubError` messages.

Every call into huggingface_hub runs inside :func:`hub_errors`, which turns an
exception raised there into a HubError saying what failed and what to do. The
message comes from :data:`MESSAGES`, one table of exception type to message
builder, searched in order: a subclass comes before its base, so the most specific
type answers. An exception no row matches is raised unchanged, and so is a
:class:`~timm_layerscale.errors.LayerScaleError` (already one line).

Importing this module imports huggingface_hub, not torch.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from huggingface_hub import constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    LocalTokenNotFoundError,
    OfflineModeIsEnabled,
    RevisionNotFoundError,
)

from ..errors import HubError, LayerScaleError

__all__ = ["HubCall", "MESSAGES", "hub_errors", "hub_message", "one_line"]


def one_line(x: Any, limit: int = 160) -> str:
    """``str(x)`` on one line (runs of whitespace become one space), cut to ``limit`` characters."""
    text = " ".join(str(x).split())
    return text[: limit - 3] + "..." if len(text) > limit else text


@dataclass(frozen=True)
class HubCall:
    """What was being done when a Hub call failed: the facts a message names.

    Attributes:
        action: What was being done, worded to follow "while" (``"uploading to ORG/NAME"``).
        repo_id: The repository.
        endpoint: The Hub address.
        revision: The branch or revision asked for, if any.
        download: The call reads (401/403/404 mean "missing or private") rather
            than writes (they mean "token").
    """

    action: str
    repo_id: str
    endpoint: str
    revision: str | None = None
    download: bool = False


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The connection failures: the transport errors of huggingface_hub's HTTP client, and the built-in ones."""
    try:
        from huggingface_hub.utils import httpx  # the client huggingface_hub uses (httpx2 from 2.0, httpx in 1.x)
    except ImportError:  # 1.x before 1.30 does not export it
        httpx = importlib.import_module("httpx")
    return (httpx.TransportError, ConnectionError, TimeoutError)


# ---- message builders: (exception, call) -> message --------------------------------------


def _offline_mode(e: BaseException, call: HubCall) -> str:
    return f"HF_HUB_OFFLINE is set, so {call.action} is not possible; unset it and retry"


def _gated(e: BaseException, call: HubCall) -> str:
    return f"{call.repo_id} is gated; accept its terms on the Hub, run 'hf auth login', then retry"


def _status(e: HfHubHTTPError) -> int | None:
    response = getattr(e, "response", None)
    return response.status_code if response is not None else None


def _detail(e: HfHubHTTPError) -> str:
    server = getattr(e, "server_message", None)
    return f" ({one_line(server, 120)})" if server else ""


def _revision_not_found(e: RevisionNotFoundError, call: HubCall) -> str:
    if call.revision is None:
        return _http_status(e, call)
    return f"{call.repo_id} has no revision {call.revision!r} ({_status(e)}) while {call.action}; check the revision"


def _http_status(e: HfHubHTTPError, call: HubCall) -> str:
    status = _status(e)
    if call.download:
        if status in (401, 403, 404):
            return (
                f"{call.repo_id} was not found or is not accessible ({status}) while {call.action}; "
                "check the repo id, or run 'hf auth login' if it is private"
            )
        return f"the Hub answered {status} while {call.action}{_detail(e)}; check the network and retry"
    if status == 401:
        return (
            f"the Hub rejected the token (401 Unauthorized) while {call.action}; "
            "run 'hf auth login' (or set HF_TOKEN) with a valid token that has write access"
        )
    if status == 403:
        namespace = call.repo_id.split("/", 1)[0]
        return (
            f"the token may not write to {call.repo_id} (403 Forbidden); use a token with write access "
            f"to the '{namespace}' namespace ('hf auth login') or check the repo id"
        )
    if status == 404:
        if call.revision:
            return (
                f"{call.repo_id} or revision {call.revision!r} was not found on the Hub (404) while {call.action}; "
                "check the repo id and revision"
            )
        return f"{call.repo_id} was not found on the Hub (404) while {call.action}; check the repo id"
    if status == 429 or (status is not None and status >= 500):
        return f"the Hub answered {status} while {call.action}{_detail(e)}; retry in a few minutes"
    return f"the Hub answered {status} while {call.action}{_detail(e)}; check the repo id and options, then retry"


def _no_token(e: BaseException, call: HubCall) -> str:
    return "no Hugging Face token found; run 'hf auth login' or set HF_TOKEN"


def _unreachable(e: BaseException, call: HubCall) -> str:
    return (
        f"could not reach the Hub at {call.endpoint} while {call.action} ({one_line(e, 100)}); "
        "check the network (and HF_ENDPOINT) and retry"
    )


def _not_cached(e: BaseException, call: HubCall) -> str:
    """huggingface_hub's answer when the file is neither reachable nor in the cache."""
    if constants.is_offline_mode():
        return (
            f"HF_HUB_OFFLINE is set and the cache cannot serve {call.action}; "
            "unset HF_HUB_OFFLINE, check the network and retry"
        )
    return _unreachable(e, call)


def _bad_value(e: BaseException, call: HubCall) -> str:
    return f"{call.action} failed: {one_line(e)}; fix the folder or options and retry"


Builder = Callable[[Any, HubCall], str]

#: The table of messages. Each row is an exception type (or a tuple of types) and
#: the builder of its message; the first row whose types the exception is an
#: instance of answers, so a subclass comes before its base.
MESSAGES: Sequence[tuple[type[BaseException] | tuple[type[BaseException], ...], Builder]] = (
    (OfflineModeIsEnabled, _offline_mode),  # a ConnectionError: before the transport errors
    (GatedRepoError, _gated),  # a RepositoryNotFoundError: before HfHubHTTPError
    (RevisionNotFoundError, _revision_not_found),
    (HfHubHTTPError, _http_status),  # also a ValueError (BadRequestError): before ValueError
    (LocalTokenNotFoundError, _no_token),
    (LocalEntryNotFoundError, _not_cached),
    (_transport_errors(), _unreachable),
    (ValueError, _bad_value),
)


def hub_message(error: BaseException, call: HubCall) -> str | None:
    """The one-line message for ``error`` raised during ``call``; ``None`` when no row of :data:`MESSAGES` matches."""
    for types, build in MESSAGES:
        if isinstance(error, types):
            return build(error, call)
    return None


@contextlib.contextmanager
def hub_errors(
    action: str, repo_id: str, *, endpoint: str, revision: str | None = None, download: bool = False
) -> Iterator[None]:
    """Raise the exceptions of the block as one-line HubErrors (the arguments are :class:`HubCall`'s).

    Raises:
        HubError: The block raised an exception :data:`MESSAGES` knows.
    """
    call = HubCall(action, repo_id, endpoint, revision, download)
    try:
        yield
    except LayerScaleError:
        raise
    except Exception as e:
        message = hub_message(e, call)
        if message is None:
            raise
        raise HubError(message) from e
