"""SIGINT (Ctrl-C) and SIGTERM for every command but ``run``: one line, the shell's status, nothing partial left.

``main()`` runs each command of its own process inside ``Catch(command)`` (``run`` keeps ``training/stop.py``: it
saves a checkpoint and prints the command that resumes). A first signal raises ``Interrupted`` in the main thread
at its next Python instruction: ``staging.write_folder`` removes the folder it was building (an older output is
only replaced once the new one is complete, so it stays as it was), and ``main()`` prints one line, ``gptlocal:
<command> interrupted (SIGINT) ...``, and ends the process with 128 + the signal's number (130, 143), as
``training/stop.py``'s ``exit_status``, without the interpreter's exit handlers (``Catch.end``).

A command deep in one long native call (a compile, a library's loop) reaches no Python instruction for a while, so
a watcher thread sees each signal too (``signal.set_wakeup_fd``: Python's own handler writes the signal's number to
a pipe the moment it arrives, whatever the main thread does). If the process has not ended ``GRACE_S`` seconds
after the first signal, or a second signal comes, the watcher removes the staging folders being built, prints the
line (once) and ends the process at once with the same status. A folder being renamed into place
(``staging.committing()``) is waited for, in both paths: a signal never leaves a half-replaced output.

A signal whose handler is not ours when it arrives (``serve``: uvicorn's, which drains the server first and then
raises the signal again) is left to that handler; the re-raised signal then ends the command here, with its line
and status.
"""
import os
import select
import signal
import sys
import threading
import time

from .. import staging
from ..training.stop import SIGNALS, exit_status, name

GRACE_S = 3.0  # after the first signal: the main thread's time to unwind before the watcher ends the process

# the commands that write files: their line says what stays (every output goes through staging.write_folder,
# or eval's --output_path through an atomic rename)
WRITES = {"prepare-data", "convert", "ckpt", "lora", "quantize", "migrate-yaml", "eval", "quickstart"}


_CHILDREN = []  # the child processes a command is waiting for (``waiting_for(process)``)


class waiting_for:  # pylint: disable=invalid-name  (a context manager, read as a clause)
    """``with waiting_for(process):`` the command relays a child process (started in a session of its own) that
    stops on its own on a signal (quickstart's ``gptlocal run``, which saves a checkpoint first): each signal is
    passed on to it, and there is no deadline while it runs."""

    def __init__(self, process):
        self.process = process

    def __enter__(self):
        _CHILDREN.append(self.process)
        return self.process

    def __exit__(self, *exc):
        _CHILDREN.remove(self.process)
        return False


class Interrupted(KeyboardInterrupt):
    """A command stopped by ``signum`` (a KeyboardInterrupt, so code that tidies up on Ctrl-C does so)."""

    def __init__(self, signum, detail="", finished=False):
        super().__init__(name(signum))
        self.signum, self.detail, self.finished = int(signum), detail, finished


def line(command, signum, detail="", finished=False):
    """The one line a stopped command prints (``detail``: what the command adds, e.g. how to start again;
    ``finished``: the signal came while its output was renamed into place, and the command ended)."""
    text = f"gptlocal: {command} interrupted ({name(signum)})"
    if finished:
        text += " as it finished; its output is complete"
    elif command in WRITES:
        text += "; nothing partial was written and any earlier output is as it was"
    return f"{text}; {detail}" if detail else text + "."


def _end_quietly(signum, frame):
    os._exit(exit_status(signum))  # pylint: disable=protected-access


class Catch:
    """Our SIGINT/SIGTERM handlers and the watcher for one command (``with Catch("convert") as catch: ...``)."""

    def __init__(self, command):
        self.command = command
        self.signum = None     # the first signal
        self.reported = False  # the line is printed
        self.lock = threading.Lock()
        self.handler = self._handler  # one bound method: compared with signal.getsignal()
        self.saved, self.saved_fd, self.pipe = {}, None, None

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set in the main thread: nothing changes
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self.pipe = (read_fd, write_fd)
        self.saved = {sig: signal.signal(sig, self.handler) for sig in SIGNALS}
        self.saved_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="gptlocal-interrupt", daemon=True).start()
        return self

    def __exit__(self, *exc):
        if self.pipe is None:
            return False
        # the command is over: a signal during the interpreter's shutdown ends the process at once with its status
        # (no line: the command said how it ended), not with a traceback from an exit handler
        signal.set_wakeup_fd(self.saved_fd)
        for sig in SIGNALS:
            signal.signal(sig, _end_quietly)
        return False

    def report(self, signum, detail="", finished=False):
        """Print the line, once (from the main thread or the watcher)."""
        with self.lock:
            if self.reported:
                return
            self.reported = True
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        try:
            # on a terminal, a line of its own (after ^C, or a progress line that ends in \r)
            sys.stderr.write(("\n" if sys.stderr.isatty() else "") + line(self.command, signum, detail, finished) + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass

    @staticmethod
    def end(status):
        """End the process now, its output flushed, without the interpreter's exit handlers: a library interrupted
        half-way (an import of MindSpore cut short) can crash in its own (MindSpore's aborted the process), and
        MindSpore's teardown takes seconds."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)  # pylint: disable=protected-access

    def _handler(self, signum, frame):  # the main thread, at its next Python instruction
        with self.lock:
            first = self.signum is None
            if first:
                self.signum = int(signum)
        if first and not staging.committing():
            raise Interrupted(signum)
        # a later signal: the watcher ends the process; one while a folder is renamed into place: the command
        # finishes that, then main() reports the signal

    def _watch(self, read_fd):
        first = deadline = None
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([read_fd], [], [], timeout)
            if not ready:  # the grace period is over
                if _CHILDREN:  # a child process is ending on the signal too (quickstart's run): wait for it
                    deadline = time.monotonic() + GRACE_S
                    continue
                self._end_now(first)
            for signum in os.read(read_fd, 64):
                if signum not in SIGNALS or signal.getsignal(signum) != self.handler:
                    continue  # a handler of another (uvicorn's) answers this one
                for child in list(_CHILDREN):  # started in a session of its own: the signal is passed on
                    try:
                        child.send_signal(signum)
                    except OSError:
                        pass
                if first is None:
                    first, deadline = signum, time.monotonic() + GRACE_S
                else:  # again: end now (a child ends at once on its second signal too)
                    until = time.monotonic() + GRACE_S
                    while _CHILDREN and time.monotonic() < until:
                        time.sleep(0.05)
                    self._end_now(first)

    def _end_now(self, signum):
        while staging.committing():  # a finished folder being renamed into place: let it land
            time.sleep(0.01)
        staging.remove_active()
        self.report(signum)
        os._exit(exit_status(signum))  # pylint: disable=protected-access  (the main thread did not unwind in time)
