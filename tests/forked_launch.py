"""``gptlocal run`` processes forked from one that has imported MindSpore and MindFormers already.

A tiny ``gptlocal run`` spends ~7 of its ~10-17 s importing MindSpore (3.5 s) and MindFormers (2.3 s, of which
Hugging Face ``datasets`` 1.6 s) before its first line of gpt_local code runs; the suite starts dozens of them. A
zygote (Android's word; CPython's ``multiprocessing`` forkserver is the same idea) is a process started once per
pytest worker, exactly as ``python -m mindformers_gptlocal.cli`` starts (the same ``sys.argv[0]``, the same
environment), that imports those modules and then only forks: each child changes to its folder, points its
stdout / stderr at the caller's files and runs the CLI's ``main`` as ``__main__.py`` does. The child is a real
process running the real launcher from its first gpt_local line; what it skips is the import it shares.

Run this file to start a zygote: it reads one JSON request a line on stdin (``argv``, ``cwd``, ``out``, ``err``,
``status``; ``script``: run that Python file with ``argv`` as ``python SCRIPT ARGV...`` would, not the CLI;
``file_size_limit``: the child's RLIMIT_FSIZE, SIGXFSZ ignored),
answers each with the child's pid on stdout, and when a child ends writes its exit status (as ``subprocess``
reports it: negative for a signal) to the request's ``status`` file. End of stdin ends it.
"""
import json
import os
import signal
import sys

CLI_MAIN = None


def _child(request):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    for fd, path in ((1, request["out"]), (2, request["err"])):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(handle, fd)
        os.close(handle)
    if request.get("file_size_limit"):  # a disk that fills up: EFBIG from write() instead of a killed process
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (request["file_size_limit"],) * 2)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    code = 1
    try:
        if request.get("script"):  # `python SCRIPT ARGV...`: the script as __main__, its folder first on sys.path
            import runpy
            sys.argv[:] = [request["script"], *request["argv"]]
            sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))
            runpy.run_path(request["script"], run_name="__main__")
            code = 0
        else:
            code = CLI_MAIN(request["argv"])
            code = 0 if code is None else code  # as __main__.py's sys.exit(main()) exits
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # what an uncaught exception does to a process: the traceback, then exit 1
        import traceback
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - nothing is left to report to
                pass
    os._exit(code if isinstance(code, int) else 1)


def serve():
    global CLI_MAIN
    status_files = {}

    def reap(*_):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            path = status_files.pop(pid, None)
            if path:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                with open(path + ".part", "w") as handle:
                    handle.write(str(code))
                os.replace(path + ".part", path)

    requests, answers = sys.stdin, os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what importing prints goes to the zygote's log, not into the answers
    import mindspore  # noqa: F401 - the import the children share
    import mindformers  # noqa: F401
    from mindformers_gptlocal.cli.main import main
    from mindformers_gptlocal.mf import run_yaml  # noqa: F401
    CLI_MAIN = main
    import gc
    gc.collect()
    gc.freeze()  # what the imports made, out of every child's collections (MindSpore's before each compile)
    signal.signal(signal.SIGCHLD, reap)
    answers.write("ready\n")
    answers.flush()
    for line in requests:
        request = json.loads(line)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        pid = os.fork()
        if pid == 0:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            _child(request)
        status_files[pid] = request["status"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        answers.write(f"{pid}\n")
        answers.flush()


if __name__ == "__main__":
    sys.argv[0] = sys.argv[1]  # the CLI's __main__.py, as `python -m mindformers_gptlocal.cli` has it
    del sys.argv[1:]
    sys.path[0] = os.getcwd()
    serve()
