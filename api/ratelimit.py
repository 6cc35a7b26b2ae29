"""Per-key token buckets: ``burst`` requests at once, refilled at ``per_minute``.

Held in the API process: with several API processes each enforces its own share. A refused
request gets 429 with ``Retry-After`` (retryable: the SDKs back off and try again).
"""

from __future__ import annotations

import threading
import time

from api.errors import ApiError


class RateLimiter:
    def __init__(self, per_minute: float, burst: int):
        self.rate, self.burst = per_minute / 60.0, burst
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last time)
        self._lock = threading.Lock()

    def check(self, key: str) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(key, (float(self.burst), now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            if tokens < 1:
                self._buckets[key] = (tokens, now)
                wait = (1 - tokens) / self.rate
                raise ApiError(
                    429,
                    f"Rate limit reached for this API key: {self.rate * 60:g} requests per minute "
                    f"(bursts of {self.burst}); retry in {wait:.1f}s",
                    code="rate_limit_exceeded",
                    headers={"retry-after": f"{max(1, round(wait))}"},
                )
            self._buckets[key] = (tokens - 1, now)
