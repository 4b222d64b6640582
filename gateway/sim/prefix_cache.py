"""An LRU prefix cache over chained prompt-block keys (see ``tokens.py``).

Chains are touched and inserted last block first, so the first block of a prompt is always the
most recent of its chain. Eviction then trims chains from their tails, like a radix-tree KV
cache evicting leaves: a surviving block is always usable, because its predecessors survive too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    def __init__(self) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, keys: Sequence[int]) -> int:
        """How many leading blocks of ``keys`` are cached; those become most recently used."""
        hit = 0
        for key in keys:
            if key not in self._blocks:
                break
            hit += 1
        for key in reversed(keys[:hit]):
            self._blocks.move_to_end(key)
        return hit

    def insert(self, keys: Sequence[int], max_blocks: int) -> None:
        blocks = self._blocks
        for key in reversed(keys):
            if key in blocks:
                blocks.move_to_end(key)
            else:
                blocks[key] = None
        self.shrink(max_blocks)

    def shrink(self, max_blocks: int) -> None:
        blocks = self._blocks
        while len(blocks) > max(0, max_blocks):
            blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
