"""The model author's sampling defaults, from the checkpoint's generation_config.json, as vLLM's
`--generation-config auto` reads them: requests that leave a field unset get the author's value."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json field -> SamplingParams field (the ones vLLM takes from it).
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(setting: str, model_folder: Path | None) -> dict[str, Any]:
    """The generation_config.json that applies. setting: 'auto' (the model folder's), 'vllm' (none: vLLM's
    own defaults) or a folder holding one."""
    if setting == "vllm":
        return {}
    folder = model_folder if setting == "auto" else Path(setting)
    if folder is None or not (folder / "generation_config.json").is_file():
        if setting != "auto":
            raise ValueError(f"generation_config: {setting!r} holds no generation_config.json")
        return {}
    path = folder / "generation_config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: {str(path)!r} is not valid JSON: {e}") from e


def eos_token_ids(config: dict[str, Any]) -> list[int]:
    """The eos_token_id field of a config.json or generation_config.json: one id or a list."""
    eos = config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return [int(i) for i in ids if i is not None]


def generation_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams defaults from a generation config. Unknown fields are left out."""
    defaults = {ours: config[theirs] for theirs, ours in FIELDS.items() if config.get(theirs) is not None}
    if defaults:
        logger.info("Default sampling parameters from the model's generation_config.json: %s "
                    "(--generation-config vllm ignores them)",
                    ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults
