"""`data.reward=http`: a reward service over HTTP, asked for a batch of responses per request.

Each request POSTs ``{"items": [{"prompt": ..., "response": ..., "answer": ...}, ...]}`` (JSON,
`data.reward_batch_size` items) to `data.reward_url` and takes ``{"rewards": [r0, r1, ...]}``
back, one finite number per item, in order. A request that fails in a way a later one may not
(HTTP 5xx or 429, a refused, reset or timed-out connection) is sent again after
`data.reward_backoff_s`, doubled before each next try, `data.reward_retries` times; any other
answer (HTTP 4xx, a body that is not the rewards of every item) fails at once. Requests run through
the scoring pool (`moe_rl.rewards.pool`), `data.reward_workers` at a time.
"""

from __future__ import annotations

import http.client
import json
import math
import numbers
import time
import urllib.error
import urllib.request
from typing import Any

from moe_rl.rewards.pool import CallError

BODY_SHOWN = 200
"""Characters of a service's answer an error message quotes."""


class _Retry(Exception):
    """A failure a later request may not meet."""


class HttpReward:
    """The rewards of a batch of items from the service at ``url``; each request within
    ``timeout_s`` (None: no limit), ``retries`` more tries after ``backoff_s``, doubling."""

    def __init__(self, url: str, timeout_s: float | None, retries: int, backoff_s: float):
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s

    def longest_s(self) -> float | None:
        """The longest a call may take: every try at its time limits (to connect, then to be
        answered), and the waits between them."""
        if self.timeout_s is None:
            return None
        waits = sum(self.backoff_s * 2**k for k in range(self.retries))
        return (self.retries + 1) * 2 * self.timeout_s + waits

    def __call__(self, items: list[dict[str, str]]) -> list[float]:
        body = json.dumps({"items": items}).encode()
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return _rewards(self._post(body), len(items))
            except _Retry as exc:
                last = str(exc)
        tries = self.retries + 1
        raise CallError(
            f"{last} ({tries} tr{'ies' if tries > 1 else 'y'}, data.reward_retries={self.retries})"
        )

    def _post(self, body: bytes) -> bytes:
        request = urllib.request.Request(
            self.url, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            said = f"answered HTTP {exc.code} {exc.reason}: {_shown(exc.read())}"
            if exc.code >= 500 or exc.code == 429:
                raise _Retry(said) from exc
            raise CallError(said) from exc
        except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:  # TimeoutError is one
            reason = getattr(exc, "reason", None) or exc
            raise _Retry(f"could not be reached: {type(reason).__name__}: {reason}") from exc


def _shown(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")
    return repr(text[:BODY_SHOWN] + ("..." if len(text) > BODY_SHOWN else ""))


def _rewards(raw: bytes, count: int) -> list[float]:
    """The ``count`` rewards of a service's answer, or a `CallError` saying what it answered."""
    try:
        rewards: Any = json.loads(raw)["rewards"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CallError(f'answered {_shown(raw)}, not {{"rewards": [...]}}') from exc
    if not isinstance(rewards, list) or len(rewards) != count:
        got = f"{len(rewards)} rewards" if isinstance(rewards, list) else repr(rewards)[:BODY_SHOWN]
        raise CallError(f"answered {got} for {count} responses")
    for k, value in enumerate(rewards):
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise CallError(f"answered {value!r} for item {k}; every reward must be a finite number")
    return [float(value) for value in rewards]
