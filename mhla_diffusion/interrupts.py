"""SIGTERM stops a command the way Ctrl-C does, once.

A scheduler's preemption, `kill`, and accelerate launch (from 1.16 it answers Ctrl-C by terminating
its child, which the terminal has interrupted already) all send SIGTERM, and only KeyboardInterrupt
runs the cleanup that keeps a user's files whole and says how to resume. So the first SIGINT or
SIGTERM raises it; a SIGTERM after that is ignored while the command unwinds, and a second Ctrl-C
still raises (a user insisting).
"""

from __future__ import annotations

import contextlib
import signal
import threading

_stopping = False  # a signal has raised KeyboardInterrupt; the command is unwinding


def _interrupt(signum, frame):
    global _stopping
    if _stopping and signum == signal.SIGTERM:
        return
    _stopping = True
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def terminate_as_interrupt():
    """Within: SIGTERM (and SIGINT, unless it is ignored or handled elsewhere) raise KeyboardInterrupt
    once. Signals reach only the main thread; nested uses are the outer one."""
    global _stopping
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is _interrupt:
        yield
        return
    taken = [signal.SIGTERM] + [signal.SIGINT] * (signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    previous = {sig: signal.signal(sig, _interrupt) for sig in taken}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stopping = False  # for the next command in this process
