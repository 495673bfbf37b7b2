"""Hub failures as one-line :class:`~timm_layerscale.errors.HubError` messages.

Every call into huggingface_hub runs inside :func:`hub_errors`, which turns an exception
raised there into a HubError saying what failed and what to do. The checks run from the
most specific type to its bases (a gated repository is also a missing one, offline mode
also a connection error). An exception none of them names is raised unchanged, and so is
a :class:`~timm_layerscale.errors.LayerScaleError` (already one line).

Importing this module imports huggingface_hub, not torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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

__all__ = ["hub_errors", "one_line"]


def one_line(x: Any, limit: int = 160) -> str:
    """``str(x)`` on one line (runs of whitespace become one space), cut to ``limit`` characters."""
    text = " ".join(str(x).split())
    return text[: limit - 3] + "..." if len(text) > limit else text


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection failures: the transport errors of huggingface_hub's HTTP client, and the built-in ones."""
    from huggingface_hub.utils import httpx  # the client huggingface_hub uses (httpx2 from 2.0, httpx in 1.x)

    return (httpx.TransportError, ConnectionError, TimeoutError)


def _http_message(e: HfHubHTTPError, action: str, repo_id: str, revision: str | None, download: bool) -> str:
    response = getattr(e, "response", None)
    status = response.status_code if response is not None else None
    server = getattr(e, "server_message", None)
    detail = f" ({one_line(server, 120)})" if server else ""
    if isinstance(e, RevisionNotFoundError) and revision is not None:
        return f"{repo_id} has no revision {revision!r} ({status}) while {action}; check the revision"
    if download:  # reading: 401, 403 and 404 mean missing or private
        if status in (401, 403, 404):
            return f"{repo_id} was not found or is not accessible ({status}) while {action}; check the repo id, or run 'hf auth login' if it is private"
        return f"the Hub answered {status} while {action}{detail}; check the network and retry"
    if status == 401:
        return f"the Hub rejected the token (401 Unauthorized) while {action}; run 'hf auth login' (or set HF_TOKEN) with a valid token that has write access"
    if status == 403:
        return (
            f"the token may not write to {repo_id} (403 Forbidden); use a token with write access "
            f"to the '{repo_id.split('/', 1)[0]}' namespace ('hf auth login') or check the repo id"
        )
    if status == 404:
        what = f"{repo_id} or revision {revision!r}" if revision else repo_id
        return f"{what} was not found on the Hub (404) while {action}; check the repo id{' and revision' if revision else ''}"
    if status == 429 or (status is not None and status >= 500):
        return f"the Hub answered {status} while {action}{detail}; retry in a few minutes"
    return f"the Hub answered {status} while {action}{detail}; check the repo id and options, then retry"


def _message(
    e: BaseException, action: str, repo_id: str, endpoint: str, revision: str | None, download: bool
) -> str | None:
    unreachable = f"could not reach the Hub at {endpoint} while {action} ({one_line(e, 100)}); check the network (and HF_ENDPOINT) and retry"
    if isinstance(e, OfflineModeIsEnabled):
        return f"HF_HUB_OFFLINE is set, so {action} is not possible; unset it and retry"
    if isinstance(e, GatedRepoError):
        return f"{repo_id} is gated; accept its terms on the Hub, run 'hf auth login', then retry"
    if isinstance(e, HfHubHTTPError):  # also a ValueError (BadRequestError)
        return _http_message(e, action, repo_id, revision, download)
    if isinstance(e, LocalTokenNotFoundError):
        return "no Hugging Face token found; run 'hf auth login' or set HF_TOKEN"
    if isinstance(e, LocalEntryNotFoundError):  # neither reachable nor in the cache
        if constants.is_offline_mode():
            return f"HF_HUB_OFFLINE is set and the cache cannot serve {action}; unset HF_HUB_OFFLINE, check the network and retry"
        return unreachable
    if isinstance(e, _transport_errors()):
        return unreachable
    if isinstance(e, ValueError):
        return f"{action} failed: {one_line(e)}; fix the folder or options and retry"
    return None


@contextlib.contextmanager
def hub_errors(
    action: str, repo_id: str, *, endpoint: str, revision: str | None = None, download: bool = False
) -> Iterator[None]:
    """Raise the exceptions of the block as one-line HubErrors.

    Args:
        action: What is being done, worded to follow "while" (``"uploading to ORG/NAME"``).
        repo_id: The repository.
        endpoint: The Hub address.
        revision: The branch or revision asked for, if any.
        download: The block reads (401/403/404 mean "missing or private") rather than
            writes (they mean "token").

    Raises:
        HubError: The block raised an exception of huggingface_hub, a connection
            failure or a ValueError.
    """
    try:
        yield
    except LayerScaleError:
        raise
    except Exception as e:
        message = _message(e, action, repo_id, endpoint, revision, download)
        if message is None:
            raise
        raise HubError(message) from e
