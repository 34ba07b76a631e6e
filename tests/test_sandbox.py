"""The sandbox for model-written code: real bwrap, real processes, real containment.

Without a working bubblewrap the tests marked ``needs_bwrap`` are skipped with the reason
(``apt-get install bubblewrap``); CI installs it and sets POSTTRAIN_REQUIRE_HOST_TOOLS=1, under
which they fail instead of skipping (tests/conftest.py). Each containment test also shows that the thing it blocks does happen
outside the sandbox, so it can fail.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from stages.rewards import sandbox
from stages.rewards.sandbox import SandboxUnavailable, run_sandboxed


GENEROUS_S = 60.0  # the wall clock of a run whose subject is not time: bwrap's and Python's start-up count


def run(code: str, **kwargs):
    """``code`` sandboxed; the wall-clock limit is generous unless the test sets one (on a loaded machine the
    start-up alone can take seconds, and a run that is not about time must not become a timeout)."""
    return run_sandboxed(textwrap.dedent(code), **{"timeout_s": GENEROUS_S, **kwargs})


def processes_with_marker(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker``."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if marker.encode() in Path(entry.path, "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.fixture()
def private_tempdir(tmp_path, monkeypatch):
    """Make run_sandboxed create its throwaway dir under tmp_path, so we can watch it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.mark.needs_bwrap
def test_bwrap_is_installed():
    assert shutil.which("bwrap"), "bubblewrap is not installed: `apt-get install bubblewrap` (CI must install it)"
    sandbox.check_sandbox()  # raises SandboxUnavailable with bwrap's own error if it cannot start


@pytest.mark.needs_bwrap
def test_runs_stdlib_code_with_stdin_files_and_exit_status():
    result = run(
        """
        import json, sys, helper
        line = input()
        print(json.dumps({"line": line, "x": helper.X}))
        sys.exit(3)
        """,
        stdin="hello\n",
        files={"helper.py": "X = 41 + 1\n"},
    )
    assert result.stdout.strip() == '{"line": "hello", "x": 42}'
    assert (result.returncode, result.timed_out, result.killed_reason) == (3, False, None)


@pytest.mark.needs_bwrap
def test_parent_secret_is_not_visible_inside(monkeypatch):
    secret = "posttrain-secret-" + secrets.token_hex(8)
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", secret)
    code = textwrap.dedent(
        """
        import os
        print(dict(os.environ))
        for pid in os.listdir("/proc"):  # every environment this code can see
            if pid.isdigit():
                try:
                    print(open(f"/proc/{pid}/environ", "rb").read())
                except OSError:
                    pass
        """
    )
    outside = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert secret in outside.stdout  # a plain subprocess does inherit it

    result = run_sandboxed(code, timeout_s=GENEROUS_S)
    assert result.returncode == 0, result.stderr
    assert "PATH" in result.stdout
    assert secret not in result.stdout and "POSTTRAIN_TEST_SECRET" not in result.stdout


@pytest.mark.needs_bwrap
def test_no_network_not_even_the_hosts_loopback():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # reachable from outside the sandbox: the probe below can fail
        # 192.0.2.1 is TEST-NET-1 (documentation, never routed): were the sandbox broken,
        # the attempt still would not reach anyone.
        result = run(
            f"""
            import socket
            for address in [("127.0.0.1", {port}), ("192.0.2.1", 80)]:
                try:
                    socket.create_connection(address, timeout=2).close()
                    print(address, "CONNECTED")
                except OSError as error:
                    print(address, "FAILED", error)
            """
        )
    finally:
        listener.close()
    assert result.returncode == 0, result.stderr
    assert "CONNECTED" not in result.stdout
    assert f"('127.0.0.1', {port}) FAILED" in result.stdout
    assert "('192.0.2.1', 80) FAILED [Errno 101] Network is unreachable" in result.stdout


@pytest.mark.needs_bwrap
def test_writes_outside_the_working_dir_fail_and_leave_nothing(private_tempdir):
    host_dir = private_tempdir / "host"
    host_dir.mkdir()
    targets = [host_dir / "escape.txt", Path("/etc/posttrain-escape.txt"),
               Path(os.path.realpath(sys.base_prefix)) / "posttrain-escape.txt", Path("/usr/posttrain-escape.txt")]
    (host_dir / "probe.txt").write_text("writable from outside")  # the host dir is writable to us
    try:
        result = run(
            f"""
            import os
            for path in {[str(t) for t in targets]!r}:
                try:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with open(path, "w") as handle:
                        handle.write("escaped")
                    print("WROTE", path)
                except OSError as error:
                    print("REFUSED", path, error.strerror)
            with open("inside.txt", "w") as handle:
                handle.write("kept")
            print("READBACK", open("/sandbox/inside.txt").read())
            """
        )
        assert result.returncode == 0, result.stderr
        assert "READBACK kept" in result.stdout
        for target in targets[1:]:  # bound read-only or absent: the write itself fails
            assert f"REFUSED {target}" in result.stdout
        for target in targets:  # nothing reached the host, whatever happened inside
            assert not target.exists(), f"sandboxed code wrote {target}"
    finally:
        for target in targets:
            if target.exists():
                target.unlink()
    # the throwaway working dir (with inside.txt) is gone
    assert sorted(p.name for p in private_tempdir.iterdir()) == ["host"]


@pytest.mark.needs_bwrap
def test_infinite_loop_is_killed_at_the_timeout_with_everything_it_started():
    """The limit (5 s, of which start-up takes its share) bounds the run; the test bounds the time from the
    program's first line to its end, which start-up on a loaded machine does not lengthen."""
    marker = str(1_000_000 + secrets.randbelow(1_000_000))
    result = run(
        f"""
        import os, subprocess, time
        print("started", time.time(), flush=True)
        subprocess.Popen(["sleep", "{marker}"], start_new_session=True)
        print("looping", flush=True)
        while True:
            pass
        """,
        timeout_s=5.0,
    )
    ended = time.time()
    assert result.timed_out and "timeout" in result.killed_reason
    first, second = result.stdout.splitlines()
    assert second == "looping" and first.startswith("started ")
    assert ended - float(first.split()[1]) < 5.0 + 2.0
    assert processes_with_marker(f"sleep\0{marker}") == []


@pytest.mark.needs_bwrap
def test_background_processes_die_with_the_program():
    marker = str(1_000_000 + secrets.randbelow(1_000_000))
    result = run(
        f"""
        import subprocess
        subprocess.Popen(["sleep", "{marker}"], start_new_session=True)
        print("left a daemon behind")
        """
    )
    assert result.returncode == 0 and not result.timed_out
    assert processes_with_marker(f"sleep\0{marker}") == []


@pytest.mark.needs_bwrap
def test_memory_bomb_is_stopped_by_the_memory_limit():
    result = run(
        """
        blob = bytearray(4 * 2**30)  # 4 GB
        print("allocated", len(blob))
        """,
        memory_mb=512,
    )
    assert result.returncode != 0 and "allocated" not in result.stdout
    assert result.killed_reason == "memory limit (MemoryError)"
    # the host is unharmed: the next run works
    assert run("print(sum(range(10)))").stdout == "45\n"


@pytest.mark.needs_bwrap
def test_gradual_memory_growth_stops_near_the_limit():
    result = run(
        """
        chunks = []
        try:
            while True:
                chunks.append(bytearray(50 * 2**20))
        except MemoryError:
            print("held MB", 50 * len(chunks))
        """,
        memory_mb=256,
    )
    assert result.returncode == 0, result.stderr
    held = int(result.stdout.split()[-1])
    assert 100 <= held <= 256


@pytest.mark.needs_bwrap
def test_fork_bomb_is_contained_by_the_process_limit():
    marker = str(1_000_000 + secrets.randbelow(1_000_000))
    result = run(
        f"""
        import os
        forked = 0
        for _ in range(200):
            try:
                pid = os.fork()
            except OSError as error:
                print("fork refused:", error.strerror)
                break
            if pid == 0:
                os.execv("/usr/bin/sleep", ["sleep", "{marker}"])
            forked += 1
        print("forked", forked)
        """,
        max_processes=16,
    )
    assert result.returncode == 0, result.stderr
    assert "fork refused: Resource temporarily unavailable" in result.stdout
    assert int(result.stdout.split()[-1]) < 16
    assert processes_with_marker(f"sleep\0{marker}") == []


@pytest.mark.needs_bwrap
def test_huge_output_is_capped_keeping_head_and_tail():
    result = run(
        """
        import sys
        sys.stdout.write("H" + "x" * 3_000_000 + "T\\n")
        """,
        max_output_bytes=10_000,
    )
    assert result.returncode == 0
    assert len(result.stdout) < 11_000
    assert result.stdout.startswith("H") and result.stdout.endswith("T\n")
    assert "bytes omitted" in result.stdout


@pytest.mark.needs_bwrap
def test_file_size_limit():
    result = run('open("big.bin", "wb").write(b"0" * (8 * 2**20))', max_file_mb=4)
    assert result.returncode != 0
    assert result.killed_reason == "file size limit (EFBIG)"


@pytest.mark.needs_bwrap
def test_file_names_must_stay_inside_the_working_dir():
    with pytest.raises(ValueError, match="relative path"):
        run_sandboxed("pass", files={"../escape.py": "x"})


def test_missing_bwrap_is_a_clear_error_never_an_unsandboxed_run(tmp_path, monkeypatch):
    marker = tmp_path / "ran.txt"
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on this PATH
    sandbox.check_sandbox.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
            run_sandboxed(f"open({str(marker)!r}, 'w').write('ran')")
    finally:
        sandbox.check_sandbox.cache_clear()
    assert not marker.exists()
