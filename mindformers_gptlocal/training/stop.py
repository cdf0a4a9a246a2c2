"""Stopping a training run safely on SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption).

A first signal during training asks for a stop: the step that runs finishes, ``GPTLocalCheckpointMonitor``
(``stop_on_signal``, on by default) saves a checkpoint the way its periodic saves do, prints the file and the
command that resumes, and the process exits with 128 + the signal's number (130, 143). A second signal ends the
process at once (the newest complete checkpoint stays: saves are crash-safe). Outside training (loading,
compiling, after the last step) a signal ends the process at once, as it would without gpt_local.

Two ways of seeing the signals, because MindSpore's runtime installs its own SIGINT handler around every graph
step, which turns SIGINT into SIGTERM (``kill(getpid(), SIGTERM)``):

- ``hold()``, called by the process's own launcher (``gptlocal run``, ``run_scripts/run_mindformer.py`` and so
  each msrun rank) before MindSpore is imported: SIGINT and SIGTERM are blocked in every thread (threads inherit
  the mask) and one watcher thread takes them with ``sigtimedwait``; MindSpore's handler is never called, so the
  signal is seen as sent. Children started by ``os.fork`` get the signals unblocked again.
- otherwise (MindFormers' own ``run_mindformer.py``, a script calling ``Trainer.train()``): Python handlers from
  the first step to the end of training. A SIGINT that lands inside a graph step reaches them as SIGTERM; the run
  stops the same safe way and reports SIGTERM. The process ends through ``SystemExit`` after training, since
  nothing of gpt_local runs after ``Trainer.train()`` returns there.

This module is pure Python (no MindSpore): the launcher imports it before anything heavy.
"""
import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)
NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}
PREFIX = "[gptlocal]"


def name(signum):
    return NAMES.get(signum, f"signal {signum}")


def exit_status(signum):
    """The shell's status for a process ended by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


class _State:
    """The process's one stop state."""

    def __init__(self):
        self.lock = threading.Lock()
        self.held = False           # hold(): signals blocked, taken by the watcher thread
        self.launcher = False       # gpt_local's launcher runs this process's training (it sets the exit status)
        self.armed = False          # a GPTLocalCheckpointMonitor with stop_on_signal is training
        self.received = None        # the first signal while armed
        self.stopped = None         # the signal the run stopped for (every rank agreed), set by the monitor
        self.watcher = None
        self.closing = threading.Event()
        self.saved_handlers = {}


STATE = _State()


def _write(line):
    """One line on stderr, flushed (from the watcher thread or a signal handler)."""
    try:
        sys.stdout.flush()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _end_now(signum, line):
    _write(line)
    os._exit(exit_status(signum))  # pylint: disable=protected-access  (a second signal: at once, no clean-up)


def _deliver(signum):
    """A signal arrived (watcher thread, or a Python handler in the main thread)."""
    with STATE.lock:
        first = STATE.armed and STATE.received is None
        if first:
            STATE.received = signum
    if first:
        _write(f"{PREFIX} {name(signum)}: finishing the current step, then saving a checkpoint and stopping "
               f"(send it again to stop at once, without that checkpoint)")
        if not STATE.held:  # Python handlers: a second signal takes the default action, at once, mid-step too
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
        return
    if STATE.received is not None:
        _end_now(signum, f"{PREFIX} {name(signum)} again: stopping now; the newest complete checkpoint stays "
                         f"where it was")
    _end_now(signum, f"{PREFIX} {name(signum)}: stopped")


def _watch():
    while not STATE.closing.is_set():
        try:
            info = signal.sigtimedwait(SIGNALS, 0.5)
        except InterruptedError:
            continue
        # Only SIGINT and SIGTERM are waited for, yet a number outside them was seen here once (a random value, under
        # MindSpore 2.7.2 with two launches at once, no signal sent): such a result is no signal of ours.
        if info is not None and info.si_signo in SIGNALS:
            _deliver(info.si_signo)


def _unblock_in_child():
    """A forked child (a data worker) is a process of its own: the signals unblocked, their usual handlers back."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    STATE.held, STATE.watcher, STATE.armed, STATE.received = False, None, False, None
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # forked from another thread than the main one: Python handlers cannot be set there
        pass
    STATE.saved_handlers.clear()


_FORK_HOOK = []


def hold():
    """Block SIGINT and SIGTERM in this thread (and so in every thread started after) and take them in a watcher
    thread. Call it from the main thread before MindSpore is imported; ``release()`` undoes it."""
    if STATE.held or threading.current_thread() is not threading.main_thread():
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    # A thread started before this (a library's, at its import) still takes the signals: Python handlers catch
    # what lands there (MindSpore's SIGINT handler makes a SIGINT there a SIGTERM, reported as such).
    for sig in SIGNALS:
        STATE.saved_handlers.setdefault(sig, signal.signal(sig, lambda signum, frame: _deliver(signum)))
    if not _FORK_HOOK:
        os.register_at_fork(after_in_child=_unblock_in_child)
        _FORK_HOOK.append(True)
    STATE.closing.clear()
    STATE.watcher = threading.Thread(target=_watch, name="gptlocal-stop-signals", daemon=True)
    STATE.watcher.start()
    STATE.held = True


def release():
    """Undo ``hold()`` (a launcher run inside another program, e.g. a test): the signals unblocked, the watcher
    ended, the stop state cleared."""
    if STATE.held:
        STATE.closing.set()
        if STATE.watcher is not None:
            STATE.watcher.join(2)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        STATE.held, STATE.watcher = False, None
        _restore_handlers()
    STATE.launcher = STATE.armed = False
    STATE.received = STATE.stopped = None


def arm():
    """Training starts: a first signal now asks for a safe stop. Without ``hold()``, Python handlers are installed
    (main thread only; elsewhere the signals keep their handlers and nothing is armed). Returns whether armed."""
    if not STATE.held:
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in SIGNALS:
            STATE.saved_handlers[sig] = signal.signal(sig, lambda signum, frame: _deliver(signum))
    STATE.received = STATE.stopped = None
    STATE.armed = True
    return True


def disarm():
    """Training ended: a signal ends the process at once again (without ``hold()``: the handlers from before
    ``arm()`` are back)."""
    STATE.armed = False
    if not STATE.held:
        _restore_handlers()


def _restore_handlers():
    for sig, handler in STATE.saved_handlers.items():
        if handler is not None:
            signal.signal(sig, handler)
    STATE.saved_handlers.clear()


def requested():
    """The signal number asked for a stop in this process, or 0."""
    return int(STATE.received or 0)


def mark_stopped(signum):
    """The run stops for ``signum`` (every rank agreed on the step and saved)."""
    STATE.stopped = int(signum)


def stopped():
    """The signal number the run stopped for, or None."""
    return STATE.stopped
