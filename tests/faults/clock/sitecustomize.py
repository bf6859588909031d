"""``time.sleep`` for a process run under libfaketime with its monotonic clock left alone.

Python 3.11's ``time.sleep`` waits with ``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)``, and
libfaketime 0.9.10 (Debian's) shifts that absolute monotonic deadline by the faked offset even
when told not to fake the monotonic clock: every sleep then fails with ``[Errno 22] Invalid
argument`` (wolfcw/libfaketime#426). A machine whose clock is ahead sleeps fine, so the clock
fault puts this folder on ``PYTHONPATH``: the same wait on the monotonic clock, through
``select``, which libfaketime leaves as it is. Nothing else is changed: ``time.time``,
``datetime.now`` and the clocks of every library stay ahead.
"""

import select
import time


def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        select.select([], [], [], left)


time.sleep = _sleep
