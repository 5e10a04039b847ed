"""Progress lines for long work: items done, elapsed time, ETA."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, unit: str = "layers", stream=None, every_s: float = 2.0):
        self.label, self.total, self.unit = label, total, unit
        self.done = 0
        self.start = self.last = time.perf_counter()
        self.stream = stream or sys.stderr
        self.every_s = every_s  # print at most this often, and always the last item

    def advance(self, items: int, note: str = "") -> None:
        """Record several items done at once (a batch of windows)."""
        self.done += items - 1
        self.step(note)

    def step(self, note: str = "") -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self.last < self.every_s and self.done < self.total:
            return
        self.last = now
        elapsed = now - self.start
        eta = elapsed / self.done * (self.total - self.done)
        pct = 100 * self.done / max(self.total, 1)
        extra = f" {note}" if note else ""
        print(f"[{self.label}] {self.done}/{self.total} {self.unit} ({pct:.0f}%) "
              f"{elapsed:.1f}s elapsed, ETA {eta:.1f}s{extra}", file=self.stream, flush=True)
