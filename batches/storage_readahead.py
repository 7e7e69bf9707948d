"""Read-ahead for byte ranges of objects that never change once written: the `s3` store's batch inputs
(storage_s3.read_input). The item worker's slots claim a batch's items in idx order, so the records they
read next follow the one asked for in the same object: a miss fetches a window of the object from the
requested offset, and the records that fall inside it are served from memory.

One per process, shared by its threads: the 8 slots interleave a batch's idx, so a window per thread
would fetch the same bytes 8 times. Thread-safe; a fetch covering what another thread asks is waited
for rather than made twice (the slots of a drain all miss at once at a batch's first record).

The window grows while an object is read forward: the first of an object is `first` bytes, and a miss
just past a window still held fetches twice that window's size, up to `most`. A process that reads a
few records of many objects (fair claims rotate the slots over many small batches) so fetches little
it does not use; one that reads through a large batch soon fetches `most` at a time. A record longer
than `most` is fetched alone and not kept.

Memory: the windows held are at most `budget` bytes in all, the least recently used dropped first;
besides them, a fetch under way holds its window (at most one per reading thread). Each thread that
has read says when its drain ends (`leave`); when none is left reading, every window is dropped.
Caching is safe because what is cached never changes: an input object is written once, before any of
its items can be claimed, and only deleted (with its batch) after. A window read before a batch was
deleted may still answer for it; the next miss raises as without the cache.
"""

import threading
from collections import OrderedDict
from collections.abc import Callable

# fetch(start, end) -> the object's bytes in [start, end), fewer at the object's end; raises when the
# object cannot be read.
Fetch = Callable[[int, int], bytes]


class ReadAhead:
    def __init__(self, first: int, most: int, budget: int):
        if not 0 < first <= most <= budget:
            raise ValueError("read-ahead needs 0 < first <= most <= budget")
        self.first, self.most, self.budget = first, most, budget
        self.reset()

    def reset(self) -> None:
        """Empty; also a forked child's first step (the parent's lock may have been held at the fork)."""
        self.lock = threading.Lock()
        self.windows: OrderedDict[tuple[str, int], tuple[bytes, int]] = OrderedDict()  # (rel, start) -> (data, size)
        self.flights: dict[threading.Event, tuple[str, int, int]] = {}  # fetches under way: done -> (rel, start, end)
        self.readers: set[int] = set()  # threads that read since their last leave()
        self.held = 0  # bytes in self.windows

    def read(self, rel: str, offset: int, length: int, fetch: Fetch) -> bytes:
        """[offset, offset + length) of the object `rel` names: from a window held, else from a fetch of a
        new one. Fewer bytes than `length` when the object ends first (the caller says it is truncated)."""
        if length > self.most:
            return fetch(offset, offset + length)  # as without read-ahead: not kept
        me = threading.get_ident()
        while True:
            with self.lock:
                self.readers.add(me)
                data = self._find(rel, offset, length)
                if data is not None:
                    return data
                flight = self._flight(rel, offset, length)
                if flight is None:
                    size = max(self._size(rel, offset), length)
                    done = threading.Event()
                    self.flights[done] = (rel, offset, offset + size)
                    break
            flight.wait()  # then look again: it was stored, or it failed and this thread fetches
        try:
            window = fetch(offset, offset + size)
            with self.lock:
                self._keep(rel, offset, window, size)
        finally:
            with self.lock:
                del self.flights[done]
            done.set()
        return window[:length]

    def leave(self) -> None:
        """This thread reads no more for now (its drain ended); the last one to leave drops the windows."""
        with self.lock:
            self.readers.discard(threading.get_ident())
            if not self.readers:
                self.windows.clear()
                self.held = 0

    def forget(self, rel_prefix: str) -> None:
        """Drop the windows of the objects under `rel_prefix` (a batch deleted by this process)."""
        with self.lock:
            for key in [k for k in self.windows if k[0].startswith(rel_prefix)]:
                self.held -= len(self.windows.pop(key)[0])

    def _find(self, rel: str, offset: int, length: int) -> bytes | None:
        for key, (data, _) in self.windows.items():
            if key[0] == rel and key[1] <= offset and offset + length <= key[1] + len(data):
                self.windows.move_to_end(key)
                return data[offset - key[1] : offset - key[1] + length]
        return None

    def _flight(self, rel: str, offset: int, length: int) -> threading.Event | None:
        for done, (r, start, end) in self.flights.items():
            if r == rel and start <= offset and offset + length <= end:
                return done
        return None

    def _size(self, rel: str, offset: int) -> int:
        """Twice the window held that this read goes on from (it starts at or before the offset and the
        offset is within one window's size of its end), else `first`."""
        grown = 0
        for (r, start), (_, size) in self.windows.items():
            if r == rel and start <= offset < start + 2 * size:
                grown = max(grown, 2 * size)
        return min(grown, self.most) or self.first

    def _keep(self, rel: str, start: int, data: bytes, size: int) -> None:
        old = self.windows.pop((rel, start), None)
        if old is not None:
            self.held -= len(old[0])
        self.windows[(rel, start)] = (data, size)
        self.held += len(data)
        while self.held > self.budget:
            self.held -= len(self.windows.popitem(last=False)[1][0])
