"""The one check before anything reaches for the Hugging Face hub: offline, a clear line at once."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from quillgpt.errors import UserError


def check_hub_reachable(what: str, offline: str) -> None:
    """One line at once instead of the hub client's minute of retries when there is no network.
    what: the sentence's subject ("the dataset X streams from the Hugging Face hub"); offline: what to do instead."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "") or os.environ.get("HF_DATASETS_OFFLINE", "0") not in (
        "0",
        "",
    ):
        raise UserError(f"{what}, but HF_HUB_OFFLINE is set; {offline}")
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # through a proxy: let the hub client try
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=5).close()
    except OSError as e:
        raise UserError(f"{what} and needs the network ({endpoint.hostname}: {e.strerror or e}); {offline}") from None
