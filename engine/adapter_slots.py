"""Which LoRA adapter sits in which of the device's `max_loras` slots: the scheduler's side of the adapter pool.

An adapter keeps its slot while any of its sequences runs (it is pinned); a slot whose adapter has no running
sequence is taken back least recently used first when another adapter needs one. The scheduler admits a sequence
only when its adapter is resident or a slot can be freed, so a step never holds more distinct adapters than slots.
The runner copies an adapter's weights into a slot when `slot_for` says so (SchedulerOutput.adapter_loads)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Set


class AdapterSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # resident adapters, least recently used first
        self._free = list(range(num_slots))
        self.loads = 0  # adapters copied into a slot so far (misses)

    def slot_for(self, name: str, pinned: Callable[[], Set[str]]) -> tuple[int, bool]:
        """The slot `name` runs in, and whether its weights must be copied there first. `pinned()`: the adapters of
        the running sequences, whose slots are not taken (asked only on a miss). The caller guarantees room."""
        slot = self._slot_of.get(name)
        if slot is not None:
            self._slot_of.move_to_end(name)
            return slot, False
        if self._free:
            slot = self._free.pop(0)
        else:
            held = pinned()
            victim = next(resident for resident in self._slot_of if resident not in held)
            slot = self._slot_of.pop(victim)
        self._slot_of[name] = slot
        self.loads += 1
        return slot, True

    def resident(self) -> dict[str, int]:
        return dict(self._slot_of)
