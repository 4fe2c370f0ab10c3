"""Redis flags that tell a batch's running chunks to stop: raised when the batch is cancelled or expires.

The database says a batch is stopping; the flag is how the news reaches requests already inside an engine
within a second, without every waiting chunk polling Postgres. A flag lost with Redis (or expired) costs
only speed: its chunks then run to the end, and finalize discards nothing it should keep.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

# Only chunks running when the batch stopped read the flag (later deliveries see the batch's status in the
# database), and those abort within a second: an hour is ample, and Redis cleans up after itself.
STOP_FLAG_TTL_SECONDS = 3600


class StopReason(str, enum.Enum):
    cancelled = "cancelled"  # aborted requests leave no line: the client asked for them not to run
    expired = "expired"  # aborted requests become `batch_expired` error lines, as OpenAI reports them


@dataclass(frozen=True)
class StopFlags:
    redis: Redis
    prefix: str  # the deployment's Redis key prefix (Settings.redis_prefix)

    def key(self, batch_id: str) -> str:
        return f"{self.prefix}batch-stop:{batch_id}"

    def raise_flag(self, batch_id: str, reason: StopReason) -> None:
        self.redis.set(self.key(batch_id), reason.value, ex=STOP_FLAG_TTL_SECONDS)

    def reason(self, batch_id: str) -> StopReason | None:
        """Why the batch is stopping, or None if it is not (or Redis cannot say right now: a Redis outage
        must not fail the chunks it interrupts, so they carry on and look again later)."""
        try:
            raw = self.redis.get(self.key(batch_id))
        except RedisError as unreachable:
            log.warning("cannot read the stop flag of batch %s: %s", batch_id, unreachable)
            return None
        return None if raw is None else StopReason(raw.decode() if isinstance(raw, bytes) else raw)
