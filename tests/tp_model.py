"""A tiny random-weight Llama whose head counts divide by 2, for TP=2 runs on the CPU (no download).

The embedded SmolLM2 (9 heads, 3 KV heads) cannot be split over two ranks. This model reuses its tokenizer
files and vocabulary; the weights are drawn once from a fixed seed and saved as float32 safetensors under
``$MIA_STREAM_CACHE/models/tiny-llama-tp`` (default cache ``~/.cache/mia_stream``). The build writes a temp
dir and renames it into place, so a crash never leaves a half model.

    python tests/tp_model.py        # builds (if needed) and prints the directory
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

NAME = "tiny-llama-tp"
SEED = 1234
GEOMETRY = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 32, "intermediate_size": 512}
_RECIPE = 1  # bump when GEOMETRY/SEED/the recipe change: an older build is then rebuilt
_COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
_STAMP = "tiny_llama_tp_recipe.json"


def tiny_model_dir() -> Path:
    """The model's directory, built on first use."""
    from mia_stream.model import cache_dir, default_model_dir

    target = cache_dir() / "models" / NAME
    stamp = {"recipe": _RECIPE, "seed": SEED, **GEOMETRY}
    try:
        if json.loads((target / _STAMP).read_text()) == stamp and (target / "model.safetensors").is_file():
            return target
    except (OSError, ValueError):
        pass
    source = Path(default_model_dir())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=target.parent))
    try:
        _build(source, tmp)
        (tmp / _STAMP).write_text(json.dumps(stamp))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(source: Path, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((source / "config.json").read_text())
    cfg.update(GEOMETRY, dtype="float32", max_position_embeddings=2048)
    for key in ("architectures", "transformers_version", "model_type"):
        cfg.pop(key, None)
    config = LlamaConfig(**cfg)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    for name in _COPIED:
        if (source / name).exists():
            shutil.copy2(source / name, out / name)


if __name__ == "__main__":
    print(tiny_model_dir())
