#!/usr/bin/env python3
"""Save a model's first N decoder layers as a checkpoint of its own: a draft model for speculative
decoding with the target's tokenizer and embeddings (docs/BENCHMARKS.md, speculative decoding).

    benchmarks/truncate_layers.py [--model PATH] --layers N OUT_FOLDER

--model: a folder (config.json + safetensors) or a .gguf file (read from stepahead's model cache, in
float32); default: the built-in model.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from stepahead.models.loading.loader import load_model_config

LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def truncate(source: Path, layers: int, out: Path) -> None:
    config = json.loads((source / "config.json").read_text())
    if not 1 <= layers <= config["num_hidden_layers"]:
        raise ValueError(f"--layers must be in [1, {config['num_hidden_layers']}], got {layers}")
    out.mkdir(parents=True, exist_ok=True)
    kept = {}
    for shard in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            m = LAYER.match(name)
            if m is None or int(m.group(1)) < layers:
                kept[name] = tensor
    save_file(kept, out / "model.safetensors")
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="folder or .gguf file (default: the built-in model)")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("out", type=Path)
    ns = ap.parse_args()
    config = load_model_config(ns.model, "cpu", dtype="float32")
    source = Path(config.converted or config.model)
    truncate(source, ns.layers, ns.out)
    print(f"{ns.out}: the first {ns.layers} layers of {source}")


if __name__ == "__main__":
    main()
