"""Per-key rate limits with the ``limits`` library: ``per_minute`` requests in any minute, and at
most ``burst`` of them in any ``burst / per_minute`` minutes (moving windows).

The counts live where ``KILN_RATE_LIMIT_STORAGE_URL`` says: in the API process (``memory://``,
the embedded default) or in Redis, where every API process spends one shared budget (the default
when the broker is Redis). A refused request gets 429 with ``Retry-After`` (retryable: the SDKs
back off and try again). Should Redis stop answering, requests pass and a warning is logged:
an outage of the limiter is not an outage of the API.
"""

from __future__ import annotations

import logging
import math
import time

from limits import RateLimitItem, RateLimitItemPerMinute, RateLimitItemPerSecond
from limits.storage import storage_from_string
from limits.strategies import MovingWindowRateLimiter

from api.errors import ApiError

log = logging.getLogger("kiln.api")


class RateLimiter:
    def __init__(self, per_minute: float, burst: int, storage_url: str = "memory://"):
        self.per_minute, self.burst = per_minute, burst
        self.items: list[RateLimitItem] = []  # the burst's first: a request it refuses spends no minute
        if per_minute > 0:
            if 0 < burst < per_minute:
                window = max(1, round(60 * burst / per_minute))
                self.items.append(RateLimitItemPerSecond(burst, window, namespace="kiln"))
            self.items.append(RateLimitItemPerMinute(max(1, round(per_minute)), namespace="kiln"))
        self.limiter = MovingWindowRateLimiter(storage_from_string(storage_url)) if self.items else None

    def check(self, key: str) -> None:
        if self.limiter is None:
            return
        try:
            for item in self.items:
                if not self.limiter.hit(item, key):
                    wait = max(0.0, self.limiter.get_window_stats(item, key).reset_time - time.time())
                    raise ApiError(
                        429,
                        f"Rate limit reached for this API key: {self.per_minute:g} requests per minute "
                        f"(bursts of {self.burst}); retry in {wait:.1f}s",
                        code="rate_limit_exceeded",
                        headers={"retry-after": f"{max(1, math.ceil(wait))}"},
                    )
        except ApiError:
            raise
        except Exception:  # the storage (Redis) is down: let the request through
            log.warning("rate limit storage unavailable; request not limited", exc_info=True)
