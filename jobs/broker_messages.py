"""Which chunk tasks the broker holds: what the recovery sweep reads to find a chunk whose task was lost.

Celery keeps no record a sweep could ask, so this reads kombu's Redis layout directly (`kombu.transport.redis`,
5.x): a queue is one Redis list per message priority (`<queue>` for 0, `<queue>\\x06\\x16<n>` for the others), and a
message delivered to a worker and not yet acknowledged (`task_acks_late`: until its task has run) sits in the hash
`unacked`, its delivery time in the sorted set `unacked_index`, until it is acknowledged or, past the visibility
timeout, put back in its queue. Every key carries the deployment's prefix (`global_keyprefix`).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from redis import Redis

from jobs.celery_app import MESSAGE_PRIORITIES, TaskName

PRIORITY_SEPARATOR = "\x06\x16"  # kombu's Redis Channel.sep
UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"

ChunkId = tuple[str, int]  # (batch id, chunk index)


@dataclass
class ChunkMessages:
    """The run_chunk messages the broker holds, by chunk."""

    queued: set[ChunkId] = field(default_factory=set)  # waiting in a queue for a worker
    delivered_at: dict[ChunkId, float] = field(default_factory=dict)  # unacknowledged: the newest delivery, epoch s


def chunk_messages(redis: Redis, prefix: str, queues: Iterable[str]) -> ChunkMessages:
    """The run_chunk messages waiting in `queues` and those delivered to workers and not yet acknowledged."""
    found = ChunkMessages()
    reads = redis.pipeline(transaction=False)
    for queue in queues:
        for priority in MESSAGE_PRIORITIES:
            reads.lrange(prefix + queue + (f"{PRIORITY_SEPARATOR}{priority}" if priority else ""), 0, -1)
    reads.hgetall(prefix + UNACKED_KEY)
    reads.zrange(prefix + UNACKED_INDEX_KEY, 0, -1, withscores=True)
    *waiting, unacked, delivered = reads.execute()
    for messages in waiting:
        found.queued.update(chunk for message in messages if (chunk := _chunk_of(json.loads(message))) is not None)
    delivery_times = {tag: score for tag, score in delivered}
    for tag, entry in unacked.items():
        chunk = _chunk_of(json.loads(entry)[0])  # [message, exchange, routing key]
        if chunk is not None:
            found.delivered_at[chunk] = max(found.delivered_at.get(chunk, 0.0), delivery_times.get(tag, 0.0))
    return found


def _chunk_of(message: dict[str, object]) -> ChunkId | None:
    """The chunk a Celery message (protocol 2, JSON) runs; None for any other task."""
    headers = message.get("headers")
    if not isinstance(headers, dict) or headers.get("task") != TaskName.run_chunk:
        return None
    body = str(message["body"])
    properties = message.get("properties")
    if isinstance(properties, dict) and properties.get("body_encoding") == "base64":
        body = base64.b64decode(body).decode()
    args = json.loads(body)[0]  # [args, kwargs, embed]
    return str(args[0]), int(args[1])
