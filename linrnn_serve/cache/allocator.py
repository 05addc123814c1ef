"""Free-list allocators for recurrent-state slots and KV blocks (pure Python, CPU-testable).

Index 0 of each pool is a reserved dummy and is never handed out.
"""
from __future__ import annotations


class SlotAllocator:
    def __init__(self, num_slots: int):
        self.capacity = num_slots - 1
        self._free = list(range(num_slots - 1, 0, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        s = self._free.pop()
        self._used.add(s)
        return s

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"state slot {slot} freed twice or never allocated")
        self._used.remove(slot)
        self._free.append(slot)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def used_slots(self) -> list[int]:
        return list(self._used)

    def check_all_free(self) -> None:
        if self._used or len(self._free) != self.capacity:
            raise RuntimeError(f"state slots leaked: {sorted(self._used)}")


class BlockAllocator:
    """KV blocks with reference counts (a block may be shared, e.g. by n > 1 samples of a prompt)."""

    def __init__(self, num_blocks: int):
        self.capacity = num_blocks - 1
        self._free = list(range(num_blocks - 1, 0, -1))
        self._ref: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        return out

    def share(self, block: int) -> None:
        self._ref[block] += 1

    def refcount(self, block: int) -> int:
        """Holders of `block` (0: free). A block written by one holder while shared must be copied first."""
        return self._ref.get(block, 0)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def refcounts(self) -> dict[int, int]:
        """Block -> holders, for every allocated block (integrity checks)."""
        return dict(self._ref)

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            r = self._ref.get(b)
            if r is None:
                raise RuntimeError(f"KV block {b} freed twice or never allocated")
            if r == 1:
                del self._ref[b]
                self._free.append(b)
            else:
                self._ref[b] = r - 1

    def check_all_free(self) -> None:
        if self._ref or len(self._free) != self.capacity:
            raise RuntimeError(f"KV blocks leaked: {sorted(self._ref)}")
