"""huggingface_hub's exceptions as one-line :class:`~timm_layerscale.errors.HubError` messages."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["hub_errors", "one_line"]


def one_line(x: Any, limit: int = 160) -> str:
    """``str(x)`` on one line, cut to ``limit`` characters."""
    text = " ".join(str(x).split())
    return text[: limit - 3] + "..." if len(text) > limit else text


def _http_message(status: int | None, action: str, repo_id: str, revision: str | None, download: bool) -> str:
    if download and status in (401, 403, 404):  # reading: missing or private
        return f"{repo_id} was not found or is not accessible ({status}) while {action}; check the repo id, or run 'hf auth login' if it is private"
    if status == 401:
        return f"the Hub rejected the token (401 Unauthorized) while {action}; run 'hf auth login' (or set HF_TOKEN) with a valid token that has write access"
    if status in (403, 404):
        what = f"{repo_id} (revision {revision!r})" if revision else repo_id
        return f"{what} was not found, or the token may not write to it ({status}), while {action}; check the repo id, or use a token with write access ('hf auth login')"
    advice = "retry in a few minutes" if status == 429 or (status or 0) >= 500 else "check the network and retry"
    return f"the Hub answered {status} while {action}; {advice}"


def _message(e: BaseException, action: str, repo_id: str, revision: str | None, download: bool) -> str | None:
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        LocalTokenNotFoundError,
        OfflineModeIsEnabled,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import httpx  # its HTTP client: httpx2 from 2.0, httpx in 1.x

    if isinstance(e, LocalEntryNotFoundError) and isinstance(e.__cause__, HfHubHTTPError):  # online, refused
        e = e.__cause__
    if isinstance(e, OfflineModeIsEnabled) or (isinstance(e, LocalEntryNotFoundError) and constants.is_offline_mode()):
        return f"HF_HUB_OFFLINE is set, so {action} is not possible (nothing cached); unset HF_HUB_OFFLINE and retry"
    if isinstance(e, GatedRepoError):
        return f"{repo_id} is gated; accept its terms on the Hub, run 'hf auth login', then retry"
    if isinstance(e, RevisionNotFoundError) and revision is not None:
        return f"{repo_id} has no revision {revision!r} while {action}; check the revision"
    if isinstance(e, HfHubHTTPError):
        response = getattr(e, "response", None)
        return _http_message(getattr(response, "status_code", None), action, repo_id, revision, download)
    if isinstance(e, LocalTokenNotFoundError):
        return "no Hugging Face token found; run 'hf auth login' or set HF_TOKEN"
    if isinstance(e, (LocalEntryNotFoundError, ConnectionError, TimeoutError, httpx.TransportError)):
        return f"could not reach the Hub at {constants.ENDPOINT} while {action} ({one_line(e, 100)}); check the network and retry"
    if isinstance(e, ValueError):
        return f"{action} failed: {one_line(e)}; fix the folder or options and retry"
    return None


@contextlib.contextmanager
def hub_errors(action: str, repo_id: str, *, revision: str | None = None, download: bool = False) -> Iterator[None]:
    """Raise what huggingface_hub raises in the block as a one-line HubError about ``action`` (to follow
    "while": ``"uploading to ORG/NAME"``) on ``repo_id`` at ``revision``; with ``download`` the block reads
    (401/403/404 mean missing or private) rather than writes (the token)."""
    from ..errors import HubError, LayerScaleError

    try:
        yield
    except LayerScaleError:
        raise
    except Exception as e:
        message = _message(e, action, repo_id, revision, download)
        if message is None:
            raise
        raise HubError(message) from e
