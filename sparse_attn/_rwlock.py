"""The readers-writer lock of a KVCache: decodes read concurrently;
appends, prefill and truncation write."""
import threading
import time

# A thread that finds the lock taken polls it, sleeping this long at first
# and twice as long each time after, up to the second figure (seconds).
FIRST_WAIT, LONGEST_WAIT = 5e-5, 2e-3


class RWLock:
    """Many readers or one writer; a waiting writer holds back new readers.

    A hold belongs to a thread, named by its ident, and is taken inside the
    ``try`` whose ``finally`` releases it::

        me = threading.get_ident()
        try:
            lock.acquire_write(me)
            ...
        finally:
            lock.release_write(me)

    so that no interrupt can leave it held.  CPython raises a pending
    KeyboardInterrupt (a signal's exception) only at a Python function's
    entry, after a call returns, or at a backward jump.  An interrupt
    anywhere in an acquire leaves the thread holding the lock or not, and
    the release that follows releases it or does nothing: a release drops
    the calling thread's own hold only (``me``), and does nothing when it
    has none.  A release is one C call (``set.discard``, bound when the lock
    is made), so no interrupt can come between the ``finally`` and its
    effect; for the same reason it wakes nobody (that would be a second
    step an interrupt could skip): a thread that finds the lock taken polls
    it, sleeping FIRST_WAIT at first and up to LONGEST_WAIT.  Uncontended,
    as in a model's decode loop, nobody waits.

    A thread holds one hold at most (nothing here nests): one that asks for
    the lock while it has a hold (which only a caller outside this pattern
    could have left behind) takes that hold over instead of waiting for
    itself forever.

    Attributes ``release_read(me)`` and ``release_write(me)`` are the
    releases."""

    def __init__(self):
        self._mutex = threading.Lock()
        self._readers = set()   # the idents of the threads holding a read
        self._writer = set()    # the ident of the thread holding the write, if any
        self._waiting = set()   # the idents of the writers waiting
        self.release_read = self._readers.discard
        self.release_write = self._writer.discard

    def acquire_read(self, me):
        """Take a read hold for the thread ``me`` (threading.get_ident())."""
        with self._mutex:
            if not self._writer and not self._waiting:
                self._readers.add(me)
                return
        self._wait_read(me)

    def acquire_write(self, me):
        """Take the write hold for the thread ``me`` (threading.get_ident())."""
        with self._mutex:
            if not self._writer and not self._readers:
                self._writer.add(me)
                return
        self._wait_write(me)

    def _wait_read(self, me):
        wait = FIRST_WAIT
        while True:
            with self._mutex:
                self._writer.discard(me)        # a write hold of ours: over to a read
                if me in self._readers or not (self._writer or self._waiting):
                    self._readers.add(me)
                    return
            time.sleep(wait)
            wait = min(2 * wait, LONGEST_WAIT)

    def _wait_write(self, me):
        wait = FIRST_WAIT
        try:
            while True:
                with self._mutex:
                    self._readers.discard(me)   # a read hold of ours: over to the write
                    if me in self._writer or not (self._writer or self._readers):
                        self._writer.add(me)
                        return
                    self._waiting.add(me)
                time.sleep(wait)
                wait = min(2 * wait, LONGEST_WAIT)
        finally:
            # whatever ends the wait (the hold, an interrupt): one C call
            self._waiting.discard(me)
