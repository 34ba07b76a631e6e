"""posttrain's warm process: a run's libraries imported once, forked for each later ``posttrain run``.

Before its first stage does any work, a ``posttrain run`` imports MLflow, torch,
transformers, datasets and TRL: 4 to 10 s on a 2-core machine, the larger part of a
``--only`` rerun of a small stage. With warm runs on, a ``posttrain run`` that had to pay
for them starts, as it ends, a process for its home that imports them once and then waits
(``$POSTTRAIN_HOME/warm/``); a later ``posttrain run`` hands that process its arguments,
working directory, environment and its stdin/stdout/stderr (the descriptors themselves,
over a Unix socket), and the process forks a child that runs the command exactly as the
command line would, writing straight to the caller's terminal. The caller waits for the
child's exit status and exits with it; Ctrl-C (SIGINT), SIGTERM and SIGHUP reach the
child's process group, and if the caller dies the child's group is killed, as the caller
itself would have been.

The warm process never runs anything itself and starts no thread, so each child starts
from the same state; it imports no Prefect (Prefect reads its settings when imported, and
they depend on the run). A request is refused, and the caller runs the command itself, when:
- its environment differs from the one the warm process started with (libraries read
  some variables when imported), apart from ``PWD``, ``OLDPWD``, ``SHLVL`` and ``_``;
- it comes from another Python; or
- a module the warm process imported has changed on disk since (an edited posttrain, a
  ``pip install``): the warm process then exits too, and the next cold run starts a new one.

``POSTTRAIN_WARM``: ``1`` on, ``0`` off, unset: on when stdin and stdout are terminals
(a person's inner loop, not scripts or tests). It stops after ``POSTTRAIN_WARM_IDLE_SECONDS``
(default 600) without a request; ``posttrain server status|stop`` show and stop it.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from flows.servers import startup
from flows.recording.locks import process_start, still_running

IDLE_SECONDS = 600.0
VOLATILE_ENV = {"PWD", "OLDPWD", "SHLVL", "_"}
_HEADER = struct.Struct("!Q")  # the request's length, sent with the three descriptors


def enabled() -> bool:
    setting = os.environ.get("POSTTRAIN_WARM", "").strip().lower()
    if setting in ("1", "on", "true", "yes"):
        return True
    if setting in ("0", "off", "false", "no"):
        return False
    return sys.stdin.isatty() and sys.stdout.isatty()


def warm_dir(home: Path) -> Path:
    return home / "warm"


def _socket_path(home: Path) -> Path:
    return warm_dir(home) / "warm.sock"


def _state_path(home: Path) -> Path:
    return warm_dir(home) / "warm.json"


# ------------------------------------------------------------------ the caller's side


def run_warm(home: Path, argv: list[str]) -> int | None:
    """Have the home's warm process run ``posttrain *argv``; its exit status, or None if none served it."""
    path = _socket_path(home)
    if not path.exists() or len(os.fsencode(path)) > 100:
        return None
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(os.fsdecode(path))
        request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "python": sys.executable,
                              "path0": sys.path[0]}).encode()  # the script's dir (cwd for -m) leads sys.path
        fds = array.array("i", [0, 1, 2])
        client.sendmsg([_HEADER.pack(len(request))], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        client.sendall(request)
        replies = client.makefile("r", encoding="utf-8")
        first = json.loads(replies.readline() or "{}")
    except (OSError, ValueError):
        client.close()
        return None
    except KeyboardInterrupt:  # before the run began: closing the connection stops it if it did
        client.close()
        return 130
    if "pid" not in first:  # refused (or the process was going away): run it here
        client.close()
        return None
    return _wait_for_child(client, replies, first["pid"])


def _wait_for_child(client: socket.socket, replies, pid: int) -> int:
    def forward(signum, _frame):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    with client:
        try:
            done = json.loads(replies.readline() or "{}")
        except (OSError, ValueError):
            done = {}
    if "status" in done:
        return done["status"]
    print(f"posttrain: the warm process ended before run {pid} reported its exit status; see "
          "`posttrain server status`", file=sys.stderr)
    return 1


def start_in_background(home: Path, env: dict[str, str]) -> None:
    """Start the home's warm process (if none runs) with ``env``: the caller's environment as it started."""
    if alive(home):
        return
    directory = warm_dir(home)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "warm.log", "ab") as log:
        # run from its own directory: with -m, the working directory leads sys.path, and a project's own
        # `flows/` there would shadow posttrain's (each child still runs in its caller's directory)
        subprocess.Popen([sys.executable, "-m", "flows.servers.warm_process", str(home)], env=env, cwd=directory,
                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def read_state(home: Path) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(_state_path(home).read_text(encoding="utf-8"))
    return None


def alive(home: Path) -> bool:
    return _running(read_state(home))


def _running(state: dict | None) -> bool:
    return state is not None and still_running(state["pid"], state["process_start"])


def describe(home: Path) -> str:
    state = read_state(home)
    if not _running(state):
        return f"no warm process runs for {home}"
    ready = "ready" if _socket_path(home).exists() else "importing"
    return (f"warm process for {home}: pid {state['pid']} ({ready}), up {time.time() - state['process_start']:.0f} s, "
            f"served {state['served']} run(s), stops after {state['idle_seconds']:.0f} s without a run")


def stop(home: Path, timeout: float = 10.0) -> int | None:
    """SIGTERM the warm process: it stops taking requests and exits once its running children have; its pid."""
    state = read_state(home)
    if not _running(state):
        _state_path(home).unlink(missing_ok=True)
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(state["pid"], signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while alive(home) and time.monotonic() < deadline:
        time.sleep(0.05)
    return state["pid"]


# ------------------------------------------------------------------ the warm process


def _import_libraries() -> None:
    import mlflow.tracking  # noqa: F401
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
    startup.import_libraries()  # torch, transformers: what every stage kind imports
    import datasets  # noqa: F401
    from trl import GRPOTrainer, SFTTrainer  # noqa: F401
    import rich.live  # noqa: F401

    import flows.execution.pipeline  # noqa: F401
    import flows.spec.loading  # noqa: F401
    import stages.registry  # noqa: F401


def _module_mtimes() -> dict[str, int]:
    found = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path:
            with contextlib.suppress(OSError):
                found[path] = os.stat(path).st_mtime_ns
    return found


def _changed(mtimes: dict[str, int]) -> str | None:
    for path, mtime in mtimes.items():
        try:
            if os.stat(path).st_mtime_ns != mtime:
                return path
        except OSError:
            return path
    return None


def serve(home: Path, command) -> None:
    """The warm process's life: import, then run each accepted request's ``command(argv)`` in a forked child."""
    import fcntl

    lock = os.open(warm_dir(home) / "warm.lock", os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + 30  # one warm process per home; one that is retiring lets go within seconds
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if alive(home) or time.monotonic() > deadline:
                return  # another one serves (or is getting ready to)
            time.sleep(0.2)
    idle = float(os.environ.get("POSTTRAIN_WARM_IDLE_SECONDS", IDLE_SECONDS))
    started_env = {k: v for k, v in os.environ.items() if k not in VOLATILE_ENV}
    state = {"pid": os.getpid(), "process_start": process_start(os.getpid()), "idle_seconds": idle, "served": 0}
    _write_state(home, state)
    startup.pause()  # the imports' objects live as long as the process (flows/servers/startup.py); frozen, a
    _import_libraries()  # child's collections walk only what the child makes
    startup.end()
    if "prefect" in sys.modules or len(os.listdir("/proc/self/task")) > 8:
        print("warm process: the imports started Prefect or many threads; not serving", file=sys.stderr)
        return
    listener = _listen(home)
    if listener is not None:
        _serve_requests(home, listener, command, started_env, _module_mtimes(), state)
    os.close(lock)  # before the interpreter's slow teardown: a successor may start now


def _listen(home: Path) -> socket.socket | None:
    """The home's socket, bound under a temporary name and renamed into place once ready."""
    path = _socket_path(home)
    partial = path.with_name(f"warm.{os.getpid()}.sock")
    if len(os.fsencode(partial)) > 100:  # a Unix socket's path holds 108 bytes
        print(f"warm process: {partial} is too long a path for a Unix socket; not serving", file=sys.stderr)
        return None
    partial.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.fsdecode(partial))
    listener.listen(8)
    os.replace(partial, path)  # requests come only once everything is imported
    return listener


def _serve_requests(home: Path, listener, command, started_env: dict, mtimes: dict, state: dict) -> None:
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    # a child's exit wakes the loop at once (its caller is waiting for the status), not at the next tick
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    last_request = time.monotonic()
    try:
        while not stopping and (children or time.monotonic() - last_request < state["idle_seconds"]):
            with contextlib.suppress(InterruptedError):
                ready, _, _ = select.select([listener, woken, *children.values()], [], [], 0.5)
                for conn in ready:
                    if conn == woken:
                        os.read(woken, 512)
                    elif conn is listener:
                        last_request = time.monotonic()
                        outcome = _accept(listener, started_env, mtimes, children, command)
                        if outcome == "stale":
                            return
                        if outcome == "served":
                            state["served"] += 1
                            _write_state(home, state)
                    elif not conn.recv(1, socket.MSG_PEEK):  # the caller is gone: so goes its run
                        pid = next(p for p, c in children.items() if c is conn)
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(pid, signal.SIGKILL)
            _reap(children)
    finally:
        listener.close()
        _remove_own_files(home)
        while children:  # SIGTERM: no new requests; the running children still report to their callers
            time.sleep(0.1)
            _reap(children)


def _write_state(home: Path, state: dict) -> None:
    partial = _state_path(home).with_name(f"warm.{os.getpid()}.json")
    partial.write_text(json.dumps(state), encoding="utf-8")
    os.replace(partial, _state_path(home))


def _remove_own_files(home: Path) -> None:
    state = read_state(home)
    if state is not None and state.get("pid") == os.getpid():
        _socket_path(home).unlink(missing_ok=True)
        _state_path(home).unlink(missing_ok=True)


def _accept(listener, started_env, mtimes, children, command) -> str | None:
    conn, _ = listener.accept()
    conn.settimeout(10)
    try:
        header, ancillary, _, _ = conn.recvmsg(_HEADER.size, socket.CMSG_SPACE(3 * 4))
        fds = array.array("i")
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        (length,) = _HEADER.unpack(header)
        body = b""
        while len(body) < length:
            chunk = conn.recv(length - len(body))
            if not chunk:
                raise OSError("the caller hung up")
            body += chunk
        request = json.loads(body)
    except (OSError, ValueError, struct.error):
        conn.close()
        return None
    if len(fds) != 3:
        return _refuse(conn, fds, "expected stdin, stdout and stderr")
    if request["python"] != sys.executable:
        return _refuse(conn, fds, f"started by {sys.executable}, asked by {request['python']}")
    env = {k: v for k, v in request["env"].items() if k not in VOLATILE_ENV}
    if env != started_env:
        differ = sorted(set(env.items()) ^ set(started_env.items()))
        return _refuse(conn, fds, f"environment differs ({', '.join(sorted({k for k, _ in differ}))})")
    if (changed := _changed(mtimes)) is not None:
        _refuse(conn, fds, f"{changed} changed since the warm process started")
        return "stale"
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        listener.close()
        for other in children.values():
            other.close()
        _run_child(request, list(fds), command)  # never returns
    for fd in fds:
        os.close(fd)
    with contextlib.suppress(OSError):  # the child does this too; whichever runs first, the caller's signals find it
        os.setpgid(pid, pid)
    children[pid] = conn
    with contextlib.suppress(OSError):  # a caller gone already: the select loop sees it and kills the child
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return "served"


def _refuse(conn, fds, reason: str) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"refused": reason}).encode() + b"\n")
    conn.close()
    for fd in fds:
        os.close(fd)
    print(f"warm process: refused a request: {reason}", file=sys.stderr, flush=True)


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                code = os.waitstatus_to_exitcode(status)  # -N: killed by signal N, which a shell shows as 128 + N
                conn.sendall(json.dumps({"status": code if code >= 0 else 128 - code}).encode() + b"\n")
            conn.close()


def _run_child(request: dict, fds: list[int], command) -> None:
    """In the forked child: become the caller's ``posttrain`` command and exit with its status."""
    import atexit
    import traceback

    status = 1
    try:
        os.setpgid(0, 0)  # the caller's signals go to this group (the run and what it starts)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=stream.isatty())
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["posttrain", *request["argv"]]
        sys.path[0] = request["path0"]
        status = command(request["argv"])
    except SystemExit as stop:  # argparse's usage errors
        status = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()  # MLflow's and Prefect's flushes, as at a normal exit
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(status)
