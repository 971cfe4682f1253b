"""The health check (``--health-check CMD``): a shell command run every
``--health-interval`` seconds, the interval being its timeout too; its first failure is
an advance warning (:mod:`tp_launch.agent.advance`).

The command is the user's, run beside training on every node, so it is held to bounds:

- **checked at start**: an empty command, or one whose first word the shell cannot find
  (``command -v``), is one error line before anything starts
  (:func:`check_command`), as torchrun users expect bad input to fail fast;
- **its output is bounded**: only the last :data:`OUTPUT_KEEP` bytes are kept (a check
  that prints without end costs the agent that much memory, not gigabytes); the
  failure's line quotes the last line of them;
- **it ends with its processes**: it runs in a session of its own; when the shell exits,
  or at the timeout, the whole process group is SIGKILLed, so that a background child
  left behind (holding the output pipe open, say) neither keeps the check waiting nor
  outlives it;
- **no secrets**: its environment is the agent's less the agent's own secrets (the etcd
  password), as a worker's (:func:`tp_launch.agent.worker_env.without_agent_secrets`).

:func:`health_verdict` reads one run (pure); :class:`HealthCheck` is the thread that runs
it until it fails once.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import threading
import time

from tp_launch.agent.worker_env import without_agent_secrets
from tp_launch.config import ConfigError

# Bytes of the check's output kept (its tail): the failure line quotes the last line.
OUTPUT_KEEP = 64 << 10
# The shortest --health-interval: a shell started more often than this is a busy loop.
MIN_INTERVAL_S = 0.1


def check_command(command: str | None, interval: float) -> None:
    """``--health-check``/``--health-interval`` as given: a ConfigError (one line)
    unless the command is non-empty, parses, and its first word is something the shell
    can run here."""
    if command is None:
        return
    if not command.strip():
        raise ConfigError("--health-check: the command is empty")
    if not interval >= MIN_INTERVAL_S:
        raise ConfigError(f"--health-interval={interval!r}: at least {MIN_INTERVAL_S:g} s")
    # The shell's own parser and lookup: builtins, keywords, paths and PATH alike.
    probe = subprocess.run(
        ["sh", "-n", "-c", command], stdin=subprocess.DEVNULL, capture_output=True,
        text=True, errors="replace", timeout=10, env=without_agent_secrets(os.environ))
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["a syntax error"])[-1]
        raise ConfigError(f"--health-check {command!r} does not parse: {why}")
    first = _first_word(command)
    if first is None:
        return  # (a compound command: the shell parsed it; what it runs is its own)
    found = subprocess.run(
        ["sh", "-c", 'command -v -- "$1"', "sh", first], stdin=subprocess.DEVNULL,
        capture_output=True, timeout=10, env=without_agent_secrets(os.environ))
    if found.returncode != 0:
        raise ConfigError(f"--health-check {command!r}: {first}: command not found")


def _first_word(command: str) -> str | None:
    """The command word of a simple command (after VAR=value assignments), or None
    where it is not one plain word (a compound command, a quoted or expanded word)."""
    for word in command.split():
        if "=" in word.split("/")[0] and not word.startswith("="):
            continue  # an assignment
        if any(c in word for c in "$`\"'\\(){}[]!;&|<>*?~#"):
            return None
        return word
    return None


def health_verdict(command: str, returncode: int | None, output: str,
                   timeout_s: float) -> str | None:
    """One run of the health check: None if healthy, else the line that says why
    (``returncode`` None: it ran past ``timeout_s``), with the output's last line."""
    if returncode == 0:
        return None
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    last = lines[-1] if lines else "(no output)"
    what = (f"timed out after {timeout_s:g} s" if returncode is None else
            f"exited with {returncode}" if returncode > 0 else
            f"was killed by {_signal_name(-returncode)}")
    return f"health check {command!r} {what}: {last[:200]}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class HealthCheck:
    """Runs ``command`` (shell) every ``interval`` seconds in a thread until it fails
    once; :meth:`failure` hands that failure's line to the agent, once."""

    def __init__(self, command: str, interval: float) -> None:
        self.command = command
        self.interval = interval
        self._failure: str | None = None
        self._taken = False
        self._stop = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread = threading.Thread(target=self._run, name="tp-run-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def failure(self) -> str | None:
        """The first failure's line, the first time it is asked for after it."""
        if self._failure is None or self._taken:
            return None
        self._taken = True
        return self._failure

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            verdict = self._once()
            if verdict is not None and not self._stop.is_set():
                self._failure = verdict
                return

    def _once(self) -> str | None:
        try:
            self._proc = proc = subprocess.Popen(
                self.command, shell=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True,
                env=without_agent_secrets(os.environ))
        except OSError as e:
            return f"health check {self.command!r} cannot run: {e}"
        try:
            output, code = run_bounded(proc, self.interval)
        finally:
            self._proc = None
        return health_verdict(self.command, code, output, self.interval)

    def stop(self) -> None:
        self._stop.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            _kill_group(proc)
        self._thread.join(timeout=5.0) if self._thread.is_alive() else None


def run_bounded(proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[str, int | None]:
    """Read ``proc``'s output (its tail, :data:`OUTPUT_KEEP` bytes) until the process
    exits or ``timeout_s`` passes; then SIGKILL its process group (what it left behind
    too) and reap it. Returns the output and the exit status (None: timed out)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    kept = bytearray()
    deadline = time.monotonic() + timeout_s
    code: int | None = None
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        open_ = True
        while True:
            code = proc.poll()
            remaining = deadline - time.monotonic()
            if code is not None or remaining <= 0:
                break
            if open_ and sel.select(min(remaining, 0.05)):
                open_ = _read_some(fd, kept)
            elif not open_:
                time.sleep(min(remaining, 0.02))
        if open_:
            _read_some(fd, kept)  # what the command wrote before it exited
    _kill_group(proc)
    proc.stdout.close()
    final = proc.wait()
    return kept.decode("utf-8", "replace"), (final if code is not None else None)


def _read_some(fd: int, kept: bytearray) -> bool:
    """Read what ``fd`` has now into ``kept`` (its tail only). False at end of file."""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        kept += chunk
        if len(kept) > OUTPUT_KEEP:
            del kept[:len(kept) - OUTPUT_KEEP]


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
