"""Run untrusted, model-written Python in a bubblewrap (``bwrap``) sandbox. Design: docs/algorithms.md."""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable

SANDBOX_DIR = "/sandbox"
ISOLATION_MODES = ("bubblewrap", "rlimits-only")
MAIN_FILE = "main.py"
NOBODY = 65534
# Fresh per-run uids (as root), above normal users and subuid ranges: one run's fork bomb cannot drain another's
_UID_BASE = 1_900_000_000
_UID_POOL = 1_000_000
_SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "HOME": SANDBOX_DIR,
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
}


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here (bwrap missing or refused); nothing was executed."""


@dataclass(frozen=True)
class SandboxResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None  # None when the program ended by itself


def run_sandboxed(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    files: dict[str, str] | None = None,
    max_processes: int = 32,
    max_file_mb: int = 16,
    tmp_mb: int = 64,
    max_output_bytes: int = 1_000_000,
    isolation: str = "bubblewrap",
) -> SandboxResult:
    """Run ``code`` as /sandbox/main.py, ``files`` beside it; ``SandboxUnavailable`` if the sandbox cannot run
    here. ``isolation="rlimits-only"``: the explicit, weaker opt-out for hosts without bubblewrap."""
    if timeout_s <= 0 or memory_mb <= 0 or max_processes <= 0:
        raise ValueError(
            f"run_sandboxed: timeout_s ({timeout_s}), memory_mb ({memory_mb}) and "
            f"max_processes ({max_processes}) must be positive"
        )
    tools = ensure_available(isolation)
    privileged = os.geteuid() == 0
    sandbox_uid = _UID_BASE + secrets.randbelow(_UID_POOL) if privileged else None
    limits = _limits_argv(tools, timeout_s, memory_mb, max_processes, max_file_mb, privileged)

    run_dir = Path(tempfile.mkdtemp(prefix="posttrain-sandbox-"))
    try:
        work = run_dir / "work"
        _write_files(work, {**(files or {}), MAIN_FILE: code}, owner=sandbox_uid)
        streams = run_dir / "streams"  # outside the sandbox: the code only holds the fds
        streams.mkdir(mode=0o700)
        if tools.bwrap is None:  # rlimits-only: the code's uid must reach its dir by its real path
            os.chmod(run_dir, 0o711)
        (streams / "stdin").write_text(stdin, encoding="utf-8")

        def command(info_fd: int) -> list[str]:
            return [*limits, *_bwrap_argv(tools, work, tmp_mb, privileged, info_fd=info_fd),
                    *_drop_to_uid(tools, sandbox_uid), tools.python, "-S", "-s", "-B", MAIN_FILE]

        with open(streams / "stdin", "rb") as stdin_file, open(streams / "stdout", "wb") as stdout_file, \
                open(streams / "stderr", "wb") as stderr_file:
            std_files = (stdin_file, stdout_file, stderr_file)
            if tools.bwrap is None:
                argv = [*limits, *_drop_to_uid(tools, sandbox_uid), tools.python, "-S", "-s", "-B", "-E", MAIN_FILE]
                returncode, timed_out = _execute_unisolated(argv, work, std_files, timeout_s, sandbox_uid)
            else:
                returncode, timed_out = _execute(command, std_files, timeout_s)
        stdout = _read_capped(streams / "stdout", max_output_bytes)
        stderr = _read_capped(streams / "stderr", max_output_bytes)
    finally:
        _remove_tree(run_dir)
    reason = _killed_reason(returncode, stderr, timed_out, timeout_s)
    return SandboxResult(returncode, stdout, stderr, timed_out, reason)



@dataclass(frozen=True)
class _Tools:
    bwrap: str | None  # None: rlimits-only
    prlimit: str
    setpriv: str | None
    python: str
    python_roots: tuple[str, ...]  # directories to bind read-only so the interpreter runs


def ensure_available(isolation: str = "bubblewrap") -> _Tools:
    """The tools for ``isolation``; raises ``SandboxUnavailable`` (with what to do) if it cannot run."""
    if isolation == "bubblewrap":
        return check_sandbox()
    if isolation == "rlimits-only":
        return check_rlimits_only()
    raise ValueError(f"sandbox isolation must be one of {', '.join(ISOLATION_MODES)}, got {isolation!r}")


def check_rlimits_only() -> _Tools:
    """The opt-out's tools: prlimit (and setpriv as root) and the base interpreter; no bwrap."""
    prlimit, setpriv = _util_linux("even the rlimits-only sandbox")
    python, roots = _base_interpreter()
    return _Tools(None, prlimit, setpriv, python, roots)


def _util_linux(who: str) -> tuple[str, str | None]:
    """prlimit, and setpriv (needed as root to drop to another uid), from util-linux."""
    prlimit, setpriv = shutil.which("prlimit"), shutil.which("setpriv")
    if prlimit is None or (os.geteuid() == 0 and setpriv is None):
        raise SandboxUnavailable(f"{who} needs `prlimit` and `setpriv` from util-linux: `apt-get install util-linux`")
    return prlimit, setpriv


@functools.lru_cache(maxsize=None)
def check_sandbox() -> _Tools:
    """Find bwrap and friends and prove once that a trivial program runs in the sandbox."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "bubblewrap (`bwrap`) is not installed, and posttrain never runs model-written code "
            "unsandboxed. Install it: `sudo apt-get install bubblewrap` (Debian/Ubuntu) or "
            "`dnf install bubblewrap` (Fedora)."
        )
    prlimit, setpriv = _util_linux("the sandbox")
    python, roots = _base_interpreter()
    tools = _Tools(bwrap, prlimit, setpriv, python, roots)
    probe = _probe(tools)
    if probe.returncode != 0:
        raise SandboxUnavailable(
            f"bubblewrap is installed but could not start a sandbox (exit {probe.returncode}): "
            f"{probe.stderr.decode(errors='replace').strip()}\n"
            "bwrap needs to create namespaces: as root that takes CAP_SYS_ADMIN (a Docker container "
            "needs --privileged or --cap-add SYS_ADMIN --security-opt seccomp=unconfined); as a normal "
            "user it takes unprivileged user namespaces (on Ubuntu >= 23.10: "
            "`sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`)."
        )
    return tools


def _probe(tools: _Tools) -> subprocess.CompletedProcess:
    """Run a trivial program in the sandbox; bwrap's own errors land in stderr."""
    privileged = os.geteuid() == 0
    with tempfile.TemporaryDirectory(prefix="posttrain-sandbox-probe-") as run_dir:
        work = Path(run_dir) / "work"
        _write_files(work, {}, owner=NOBODY if privileged else None)
        argv = _bwrap_argv(tools, work, 1, privileged)
        argv += [*_drop_to_uid(tools, NOBODY if privileged else None), tools.python, "-S", "-s", "-B", "-c",
                 "import json, os; os.listdir('.')"]
        return subprocess.run(argv, capture_output=True, timeout=60, env={"PATH": "/usr/bin:/bin"})


def _base_interpreter() -> tuple[str, tuple[str, ...]]:
    """The base (non-venv) interpreter and the directories it needs outside /usr."""
    prefix = os.path.realpath(sys.base_prefix)
    exec_prefix = os.path.realpath(sys.base_exec_prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    python = os.path.join(exec_prefix, "bin", version)
    if not os.access(python, os.X_OK):
        python = os.path.realpath(sys.executable)
    roots: list[str] = []
    for path in sorted({prefix, exec_prefix, os.path.dirname(python)}, key=len):
        if path == "/usr" or path.startswith("/usr/") or any(path.startswith(r + "/") for r in roots):
            continue
        roots.append(path)
    return python, tuple(roots)


def _bwrap_argv(tools: _Tools, work: Path, tmp_mb: int, privileged: bool, info_fd: int | None = None) -> list[str]:
    # As root, skip the user namespace so that setpriv can drop to a real unprivileged uid.
    namespaces = (
        ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        if privileged
        else ["--unshare-all", "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--cap-drop", "ALL"]
    )
    argv = [tools.bwrap, *namespaces, "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    for key, value in _SANDBOX_ENV.items():
        argv += ["--setenv", key, value]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    for root in tools.python_roots:
        argv += ["--ro-bind", root, root]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    for scratch in ("/tmp", "/dev/shm"):  # RAM-backed, hence size-capped
        argv += ["--perms", "1777", "--size", str(tmp_mb * 2**20), "--tmpfs", scratch]
    argv += ["--bind", str(work), SANDBOX_DIR, "--chdir", SANDBOX_DIR]
    argv += ["--remount-ro", "/dev", "--remount-ro", "/"]  # else writable, uncapped RAM inside a userns
    if privileged:
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]  # for setpriv only; it drops all
    return argv


def _limits_argv(tools: _Tools, timeout_s: float, memory_mb: int, max_processes: int, max_file_mb: int,
                 privileged: bool) -> list[str]:
    cpu_s = math.ceil(timeout_s) + 1  # the wall clock normally fires first; this catches busy loops
    nproc = max_processes if privileged else _tasks_of_user(os.getuid()) + max_processes
    return [
        tools.prlimit,
        f"--as={memory_mb * 2**20}",
        f"--cpu={cpu_s}:{cpu_s + 1}",
        f"--nproc={nproc}",
        f"--fsize={max_file_mb * 2**20}",
        "--nofile=256",
        "--core=0",
        "--",
    ]


def _tasks_of_user(uid: int) -> int:
    """Tasks (threads included) that already count against ``uid``'s RLIMIT_NPROC (its real uid)."""
    import psutil

    return sum(p.info["num_threads"] or 1 for p in psutil.process_iter(["uids", "num_threads"])
               if p.info["uids"] is not None and p.info["uids"].real == uid)


def _write_files(work: Path, files: dict[str, str], owner: int | None) -> None:
    """The working dir with ``files``, owned by the sandbox's uid when we are root."""
    work.mkdir()
    for name, content in files.items():
        relative = PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise ValueError(f"run_sandboxed: file name {name!r} must be a relative path inside the working dir")
        target = work / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")
    if owner is not None:
        for directory, _, names in os.walk(work):
            os.chown(directory, owner, owner)
            for name in names:
                os.chown(os.path.join(directory, name), owner, owner)


def _drop_to_uid(tools: _Tools, uid: int | None) -> list[str]:
    """As root: become ``uid`` with no capabilities before starting Python (else nothing)."""
    if uid is None:
        return []
    return [tools.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--"]



def _execute(command: Callable[[int], list[str]], std_files: tuple, timeout_s: float) -> tuple[int, bool]:
    """(status, timed_out) of the sandbox, run until it exits or ``timeout_s`` passes, once its pid 1 (held by a
    pidfd) has exited: bwrap returns when the program exits, the namespace's other processes die with pid 1."""
    stdin_file, stdout_file, stderr_file = std_files
    info_read, info_write = os.pipe()  # bwrap writes {"child-pid": <host pid of pid 1>} here
    try:
        process = subprocess.Popen(command(info_write), stdin=stdin_file, stdout=stdout_file, stderr=stderr_file,
                                   pass_fds=(info_write,), start_new_session=True, env={"PATH": "/usr/bin:/bin"})
        os.close(info_write)
        info_write = -1
        pid_1_fd = _open_pid_1(info_read)
    finally:
        os.close(info_read)
        if info_write != -1:
            os.close(info_write)
    try:
        try:
            return process.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            _kill_sandbox(process, pid_1_fd)
            return process.wait(), True
        except BaseException:  # KeyboardInterrupt while waiting: never leave the sandbox behind
            _kill_sandbox(process, pid_1_fd)
            raise
    finally:
        if pid_1_fd is not None:
            _wait_for_exit(pid_1_fd, timeout_s=10)
            os.close(pid_1_fd)


def _execute_unisolated(argv: list[str], work: Path, std_files: tuple, timeout_s: float,
                        uid: int | None) -> tuple[int, bool]:
    """rlimits-only: run in its own session in ``work``; on exit or timeout kill every process of its
    fresh uid (as root) or its process group (otherwise: a process that left it survives)."""
    stdin_file, stdout_file, stderr_file = std_files
    process = subprocess.Popen(argv, cwd=work, stdin=stdin_file, stdout=stdout_file, stderr=stderr_file,
                               start_new_session=True, env={**_SANDBOX_ENV, "HOME": str(work)})
    timed_out = False
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # also on KeyboardInterrupt: never leave the code running
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
        if uid is not None:
            _kill_uid(uid)
    status = process.returncode
    return (128 - status if status < 0 else status), timed_out  # death by signal N as 128 + N, like bwrap


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` until none is left (a fresh uid that only the run used)."""
    import psutil

    for _ in range(50):
        pids = [p.pid for p in psutil.process_iter(["uids", "status"])
                if p.info["uids"] is not None and p.info["uids"].real == uid
                and p.info["status"] != psutil.STATUS_ZOMBIE]  # zombies are dead already, waiting to be reaped
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    warnings.warn(f"posttrain sandbox: processes of uid {uid} are still exiting", RuntimeWarning)


def _open_pid_1(info_read: int) -> int | None:
    """A pidfd on the sandbox's pid 1, or None if bwrap never started it."""
    data = b""
    while True:  # bwrap writes the JSON right after creating pid 1, before the program starts
        chunk = os.read(info_read, 65536)
        if not chunk:  # bwrap exited (or closed the fd) without telling
            return None
        data += chunk
        try:
            pid_1 = int(json.loads(data.decode())["child-pid"])
            break
        except (ValueError, KeyError, TypeError):
            continue
    try:  # pid 1 is bwrap's child and cannot have been reaped and recycled while bwrap runs
        return os.pidfd_open(pid_1)
    except ProcessLookupError:
        return None


def _kill_sandbox(process: subprocess.Popen, pid_1_fd: int | None) -> None:
    if pid_1_fd is not None:
        try:
            signal.pidfd_send_signal(pid_1_fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:  # bwrap itself; --die-with-parent would also take pid 1 down with it
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _wait_for_exit(pidfd: int, timeout_s: float) -> None:
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    if not poller.poll(timeout_s * 1000):
        warnings.warn("posttrain sandbox: the sandbox's processes are still exiting", RuntimeWarning)


def _read_capped(path: Path, limit: int) -> str:
    """The stream as text; past ``limit`` bytes its head and tail (the traceback) and how much was cut."""
    size = path.stat().st_size
    with open(path, "rb") as stream:
        if size <= limit:
            return stream.read().decode("utf-8", errors="replace")
        head = stream.read(limit // 2)
        stream.seek(size - limit // 2)
        tail = stream.read()
    omitted = size - len(head) - len(tail)
    return (head.decode("utf-8", errors="replace") + f"\n[posttrain sandbox: {omitted} bytes omitted]\n"
            + tail.decode("utf-8", errors="replace"))


def _killed_reason(returncode: int, stderr: str, timed_out: bool, timeout_s: float) -> str | None:
    if timed_out:
        return f"wall-clock timeout ({timeout_s:g}s)"
    if returncode > 128:  # bwrap reports death by signal N as exit status 128 + N
        number = returncode - 128
        if number == signal.SIGXCPU:
            return "cpu time limit (SIGXCPU)"
        if number == signal.SIGXFSZ:
            return "file size limit (SIGXFSZ)"
        try:
            return f"signal {signal.Signals(number).name}"
        except ValueError:
            return None
    last_line = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if returncode != 0 and last_line.startswith("MemoryError"):
        return "memory limit (MemoryError)"
    if returncode != 0 and "[Errno 27] File too large" in last_line:
        return "file size limit (EFBIG)"
    return None


def _remove_tree(path: Path) -> None:
    """Delete the run dir; retry briefly while killed sandbox processes finish dying."""
    for _ in range(40):
        try:
            shutil.rmtree(path, onerror=_make_writable_and_retry)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
    warnings.warn(f"posttrain sandbox: could not delete {path}; remove it by hand", RuntimeWarning)


def _make_writable_and_retry(function, path, _exc_info) -> None:
    # The code may have chmod-ed its files read-only (or dirs to 000); we own them (or are root).
    parent = os.path.dirname(path)
    os.chmod(parent, 0o700)
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, 0o700)
    function(path)
