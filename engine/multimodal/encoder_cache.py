"""The vision encoder's outputs, kept by image content hash: a prompt computed in several chunks, recomputed after
preemption, or sharing an image with another request runs the encoder for it once. Least recently used first out,
within a budget of embedding rows (placeholder tokens)."""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, capacity_rows: int) -> None:
        self.capacity_rows = capacity_rows  # 0: nothing is kept (every chunk that reaches an image encodes it)
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._rows = 0
        self.hits = 0  # images a step found here instead of encoding them

    def get(self, content_hash: bytes) -> torch.Tensor | None:
        rows = self._entries.get(content_hash)
        if rows is not None:
            self._entries.move_to_end(content_hash)
            self.hits += 1
        return rows

    def put(self, content_hash: bytes, rows: torch.Tensor) -> None:
        """Keep `rows` ([placeholders, hidden]); an entry larger than the whole budget is not kept."""
        if content_hash in self._entries or rows.shape[0] > self.capacity_rows:
            return
        while self._rows + rows.shape[0] > self.capacity_rows:
            _, evicted = self._entries.popitem(last=False)
            self._rows -= evicted.shape[0]
        self._entries[content_hash] = rows
        self._rows += rows.shape[0]

    @property
    def num_rows(self) -> int:
        return self._rows
