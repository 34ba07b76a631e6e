"""The README's two commands, as written, in a fresh clone of this repository.

    python3 bench/fresh_clone.py [--hide-host-tools] [--keep]

Clones the repository's committed HEAD (`git clone` of this checkout) into a temporary
directory, reads the two set-up commands from README.md's "The two commands" section (its
two ```bash blocks, so this script cannot drift from the README), and runs each one
unchanged with `bash -c` in the clone, one after the other, as a new user would: HOME is a
fresh empty directory (no pip cache, no ~/.posttrain, no Hugging Face cache) and the
environment carries none of this checkout's settings (PYTHONPATH, VIRTUAL_ENV,
POSTTRAIN_*, MLFLOW_*, PREFECT_*). pip's own configuration of the machine (/etc/pip.conf:
a local wheel directory, PIP_FIND_LINKS) is left as it is.

`--hide-host-tools` runs both commands with a PATH that lacks bubblewrap and chromium,
as on a fresh Debian/Ubuntu machine (the tests that need them must then skip, saying why).
It prints which host tools the commands could see, each command's exit status and wall
time, the quickstart's and pytest's closing lines, and PASS or FAIL; every line of output
goes, time-stamped, to fresh_clone.log in the clone's parent directory (kept with --keep).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOST_TOOLS = ("bwrap", "chromium", "chromium-browser")
HIDDEN = ("bwrap", "chromium", "chromium-browser")


def readme_commands(readme: Path) -> list[str]:
    """The ```bash blocks of the README's "## The two commands" section, in order."""
    text = readme.read_text()
    match = re.search(r"^## The two commands\n(.*?)(?=^## )", text, re.S | re.M)
    if match is None:
        sys.exit(f"{readme}: no '## The two commands' section")
    blocks = re.findall(r"^```bash\n(.*?)^```", match.group(1), re.S | re.M)
    if len(blocks) != 2:
        sys.exit(f"{readme}: 'The two commands' has {len(blocks)} bash blocks, expected 2")
    return [block.strip() for block in blocks]


def path_without(tools: tuple[str, ...], where: Path) -> str:
    """A PATH of symlink directories mirroring the current PATH, less `tools`."""
    dirs = []
    for index, entry in enumerate(os.environ["PATH"].split(os.pathsep)):
        source = Path(entry)
        if not source.is_dir():
            continue
        mirror = where / f"path{index}"
        mirror.mkdir(parents=True)
        for item in source.iterdir():
            if item.name not in tools:
                (mirror / item.name).symlink_to(item)
        dirs.append(str(mirror))
    return os.pathsep.join(dirs)


def fresh_env(home: Path, path: str) -> dict[str, str]:
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONHOME")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("POSTTRAIN_", "MLFLOW_", "PREFECT_", "HF_", "TRANSFORMERS_"))}
    env.update(HOME=str(home), PATH=path)
    return env


def run_logged(command: str, cwd: Path, env: dict, log) -> tuple[int, float, list[str]]:
    """Runs `command` with bash; every output line time-stamped into `log`; returns (rc, seconds, last lines)."""
    started = time.perf_counter()
    proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    tail: list[str] = []
    for line in proc.stdout:
        log.write(f"[{time.perf_counter() - started:7.1f}] {line}")
        log.flush()
        tail = (tail + [line.rstrip("\n")])[-30:]
    proc.wait()
    return proc.returncode, time.perf_counter() - started, tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hide-host-tools", action="store_true",
                        help="run without bubblewrap and chromium on PATH, as on a fresh machine")
    parser.add_argument("--keep", action="store_true", help="keep the clone and its log")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="posttrain-fresh-"))
    clone, home = work / "posttrain", work / "home"
    home.mkdir()
    path = path_without(HIDDEN, work / "bin") if args.hide_host_tools else os.environ["PATH"]
    env = fresh_env(home, path)
    ok = False
    try:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, check=True,
                                capture_output=True, text=True).stdout.strip()
        commands = readme_commands(clone / "README.md")
        seen = {tool: shutil.which(tool, path=path) is not None for tool in HOST_TOOLS}
        print(f"fresh clone of {commit} in {clone}; python3: "
              f"{subprocess.run(['python3', '--version'], env=env, capture_output=True, text=True).stdout.strip()}")
        print("host tools on PATH: " + ", ".join(f"{t} {'yes' if found else 'no'}" for t, found in seen.items()))
        ok = run_all(commands, clone, env, work / "fresh_clone.log")
    finally:  # the quickstart left its Prefect API server up for the next run (it would stop itself when idle)
        if (clone / ".venv" / "bin" / "posttrain").exists():
            subprocess.run([str(clone / ".venv" / "bin" / "posttrain"), "server", "stop"], cwd=clone, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if args.keep or not ok:
            print(f"kept: {work} (log: {work / 'fresh_clone.log'})")
        else:
            subprocess.run(["rm", "-rf", str(work)])
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


def run_all(commands: list[str], clone: Path, env: dict, log_path: Path) -> bool:
    with log_path.open("w") as log:
        for number, command in enumerate(commands, 1):
            print(f"command {number}: {command}", flush=True)
            log.write(f"=== command {number}: {command}\n")
            rc, seconds, tail = run_logged(command, clone, env, log)
            summary = [line for line in tail if line.strip()][-12 if number == 1 else -3:]
            print("\n".join("    " + line for line in summary))
            print(f"command {number}: exit {rc}, {seconds / 60:.1f} min wall", flush=True)
            if rc != 0:
                return False
    return True


if __name__ == "__main__":
    main()
