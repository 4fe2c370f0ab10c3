"""Cron times of a schedule: five cron fields read on the wall clock of an IANA time zone, placed in UTC.

croniter walks naive wall-clock times of the schedule's zone and zoneinfo places each on the time line (fold 0,
then the first time strictly after now), which is what makes DST days right: on the spring-forward day a time the
clock skips fires when the clock jumps, on the fall-back day a repeated time fires once, at its first occurrence.
"""

from __future__ import annotations

import functools
import zoneinfo
from datetime import datetime, timezone

from croniter import CroniterError, croniter

from jobs.errors import ServiceError

CRON_FIELDS = ("minute", "hour", "day-of-month", "month", "day-of-week")
MAX_CRON_CHARS = 128  # the column's width


def normalized_cron(expression: str) -> str:
    """The expression with single spaces; raises a client error unless it is five valid cron fields."""
    fields = expression.split()
    if len(fields) != len(CRON_FIELDS) or len(expression) > MAX_CRON_CHARS:
        raise ServiceError(
            "invalid_request",
            f"cron must be five fields ({' '.join(CRON_FIELDS)}), e.g. '0 2 * * *'; "
            f"got {expression[:MAX_CRON_CHARS]!r}",
            param="cron",
        )
    normalized = " ".join(fields)
    try:
        croniter(normalized)
    except CroniterError as invalid:
        message = f"invalid cron expression {normalized!r}: {invalid}"
        raise ServiceError("invalid_request", message, param="cron") from None
    return normalized


@functools.cache
def _time_zone_names() -> frozenset[str]:
    return frozenset(zoneinfo.available_timezones())


def check_time_zone(name: str) -> None:
    if name not in _time_zone_names():
        raise ServiceError(
            "invalid_request",
            f"timezone must be an IANA time zone name such as 'UTC' or 'Europe/Paris', got {name[:80]!r}",
            param="timezone",
        )


def next_fire_time(cron: str, time_zone: str, after: datetime) -> datetime:
    """The first time strictly after `after` (aware) that `cron` names on the wall clock of `time_zone`, in UTC."""
    zone = zoneinfo.ZoneInfo(time_zone)
    # croniter walks naive wall-clock times; zoneinfo then places each on the time line (fold=0: the first of a
    # repeated time, and for a skipped one the offset before the jump, which lands just after it).
    wall_clock = croniter(cron, after.astimezone(zone).replace(tzinfo=None))
    while True:
        try:
            candidate = wall_clock.get_next(datetime).replace(tzinfo=zone).astimezone(timezone.utc)
        except CroniterError:
            raise ServiceError("invalid_request", f"cron {cron!r} never fires", param="cron") from None
        # During a repeated hour, wall-clock times of its first pass already lie behind `after`.
        if candidate > after:
            return candidate
