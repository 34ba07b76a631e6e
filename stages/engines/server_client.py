"""The server engine: posttrain's HTTP client of a stage's generation server (``server_process``). Departs from
sending requests as they come: a batch is taken in whole, in the client's order, so a rerun draws the same samples
(docs/algorithms.md)."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from stages.engines import server_routes
from stages.engines.interface import Sample, prompt_token_ids
from stages.engines.server_process import BASE_NAME, GenerationServer, ServerFailed
from stages.sampling import SamplingSettings

WHOLE_BATCH = 1024  # the most requests taken in whole at once (a thread each); a larger batch goes in such chunks


class ServerEngine:
    """Samples from a ``GenerationServer``, each batch by one ``version`` of the weights (the newest ``keep`` kept)."""

    name = "vllm_server"
    why = "generation mode server"

    def __init__(self, server: GenerationServer, tokenizer, keep_logprobs: bool = True, concurrency: int = 64,
                 folder: Path | None = None, keep: int = 1, owns_server: bool = False):
        self.server, self.tokenizer, self.keep_logprobs = server, tokenizer, keep_logprobs
        self.folder, self.keep, self.owns_server = folder, keep, owns_server
        self.lora = server.lora_rank is not None
        self.served: dict[int, str] = {0: BASE_NAME}  # version -> served model name
        self.weights_version = 0
        self.slot = threading.Lock()  # full weights: one version at a time, not swapped under a batch (weights.py)
        self._one_batch = threading.Lock()  # whole batches: one batch on the engine at a time, from intake to answers
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="generation-request")

    def identity(self) -> dict:
        import vllm

        import torch

        return {"engine": f"vllm-{vllm.__version__}-server", "device": "cuda" if torch.cuda.is_available() else "cpu",
                "dtype": self.server.dtype}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.owns_server:
            self.server.close()

    def at(self, version: int) -> PinnedEngine:
        """This engine, drawing every batch by weights ``version``."""
        return PinnedEngine(self, version)

    def generate(self, prompts: list[list[dict]], settings: SamplingSettings) -> list[list[Sample]]:
        return self.generate_ids(prompt_token_ids(self.tokenizer, prompts), settings)

    def generate_ids(self, prompt_ids: list[list[int]], settings: SamplingSettings, seed_offset: int = 0,
                     version: int | None = None) -> list[list[Sample]]:
        """Prompt i seeded ``settings.seed + seed_offset + i``, all drawn by weights ``version`` (default: newest)."""
        version = self.weights_version if version is None else version
        if self.lora:
            return self._draw(prompt_ids, settings, seed_offset, version)
        with self.slot:
            if version != self.weights_version:
                raise ServerFailed(f"full weights: the server holds version {self.weights_version}, not {version}")
            return self._draw(prompt_ids, settings, seed_offset, version)

    def _draw(self, prompt_ids, settings: SamplingSettings, seed_offset: int, version: int) -> list[list[Sample]]:
        if version not in self.served:
            raise ServerFailed(f"weights version {version} is not served (served: {sorted(self.served)})")
        attempts = settings.draws
        common = {"model": self.served[version], "temperature": settings.temperature,
                  "top_p": settings.nucleus, "max_tokens": settings.max_tokens,
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
        return [settings.every_attempt(group) for group in groups]

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
        """The answers to ``bodies``, in batches of up to ``WHOLE_BATCH`` taken whole and scheduled in order."""
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
        """Until the server has taken in all of ``futures``' requests, or one of them failed."""
        deadline = time.monotonic() + timeout_s
        while self.server.request(f"{server_routes.ROUTE}?prefix={prefix}")["count"] < len(futures):
            if any(future.done() and future.exception() is not None for future in futures):
                return
            if time.monotonic() > deadline:
                raise ServerFailed(f"the generation server took in fewer than {len(futures)} requests in "
                                   f"{timeout_s:.0f} s; its last log lines ({self.server.log_path}):\n"
                                   f"{self.server.last_lines()}")
            time.sleep(0.002)

    def take_weights(self, model, version: int) -> bool:
        """Serve ``model``'s weights as ``version`` unless served already; whether weights were pushed."""
        from stages.engines.weights import push_to_server

        if self.weights_version >= version:
            return False
        push_to_server(self, model, version, self.folder, self.keep)
        return True


class PinnedEngine:
    """A ``ServerEngine`` held to one version of the weights (what a batch drawn ahead is drawn by)."""

    def __init__(self, engine: ServerEngine, version: int):
        self.engine, self.weights_version = engine, version

    def identity(self) -> dict:
        return self.engine.identity()

    def generate(self, prompts: list[list[dict]], settings: SamplingSettings) -> list[list[Sample]]:
        return self.generate_ids(prompt_token_ids(self.engine.tokenizer, prompts), settings)

    def generate_ids(self, prompt_ids: list[list[int]], settings: SamplingSettings,
                     seed_offset: int = 0) -> list[list[Sample]]:
        return self.engine.generate_ids(prompt_ids, settings, seed_offset, version=self.weights_version)
