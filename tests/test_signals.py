"""signal_main_thread: a stopped process's signal reaches its main thread, whichever of
its threads would run first after SIGCONT (a process-directed one may go to any)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tp_launch.procs.worker import signal_main_thread

# The main thread sleeps in one function, a second thread spins in another; SIGUSR1
# makes faulthandler dump the stack of the thread that took the signal, and only it.
CHILD = r"""
import faulthandler, signal, sys, threading, time
faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=False)
def spinning_helper():
    while True:
        pass
def sleeping_main():
    print("ready", flush=True)
    while True:
        time.sleep(0.01)
threading.Thread(target=spinning_helper, daemon=True).start()
sleeping_main()
"""


def test_the_main_thread_of_a_stopped_process_takes_the_signal():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        for _ in range(5):
            os.kill(child.pid, signal.SIGSTOP)
            signal_main_thread(child.pid, signal.SIGUSR1)
            os.kill(child.pid, signal.SIGCONT)
            time.sleep(0.2)
    finally:
        child.kill()
        _, err = child.communicate(timeout=30)
    dumps = err.count("Stack (most recent call first)") + err.count("Current thread")
    assert dumps == 5, err
    assert err.count("sleeping_main") == 5 and "spinning_helper" not in err, err


def test_a_process_that_is_gone_is_a_lookup_error():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    with pytest.raises(ProcessLookupError):
        signal_main_thread(child.pid, signal.SIGUSR1)
