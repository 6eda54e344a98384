"""Plain HTTP helpers for the API tests (urllib: no client library between the test and the server)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request


def http_status(url: str) -> int | None:
    """The status code of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)
