"""The readers-writer lock of a KVCache: decodes read concurrently;
appends, prefill and truncation write."""
import threading


class RWLock:
    """Many readers or one writer; a waiting writer holds back new readers.

    The plain lock is entered directly (a C-level context manager) and the
    condition is notified only when a thread sleeps on it: a decode step
    takes this lock twice per layer, so its cost is per token."""

    def __init__(self):
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._readers = 0
        self._writer = False
        self._waiting = 0      # writers waiting
        self._sleepers = 0     # threads inside _cond.wait()

    def _sleep(self):
        self._sleepers += 1
        try:
            self._cond.wait()
        finally:
            self._sleepers -= 1

    def acquire_read(self):
        with self._mutex:
            while self._writer or self._waiting:
                self._sleep()
            self._readers += 1

    def release_read(self):
        with self._mutex:
            self._readers -= 1
            if not self._readers and self._sleepers:
                self._cond.notify_all()

    def acquire_write(self):
        with self._mutex:
            self._waiting += 1
            try:
                while self._writer or self._readers:
                    self._sleep()
            except BaseException:      # interrupted: let held-back readers in
                self._waiting -= 1
                if self._sleepers:
                    self._cond.notify_all()
                raise
            self._waiting -= 1
            self._writer = True

    def release_write(self):
        with self._mutex:
            self._writer = False
            if self._sleepers:
                self._cond.notify_all()
