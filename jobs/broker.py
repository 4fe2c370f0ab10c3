"""kombu's Redis transport, made to survive a Redis restart (`broker_transport` in `jobs.celery_app`).

When the worker's broker connection drops, Celery closes it and, while closing, kombu (5.7) closes the channel a
second time after the connection has let go of its settings. Building a Redis client for that second close
then raised AttributeError, which Celery does not expect there: the whole worker exited ("Unrecoverable
error"). Here that case raises a connection error instead, which Celery's close path ignores, and the worker
reconnects once Redis is back. The messages it could not hand back are in Redis's unacked set and return
after the visibility timeout.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis
from redis.exceptions import ConnectionError as RedisConnectionError


class Channel(kombu_redis.Channel):
    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection.client is None:
            raise RedisConnectionError("the broker connection is already closed")
        params: dict[str, Any] = super()._connparams(asynchronous)
        return params


class Transport(kombu_redis.Transport):
    Channel = Channel
