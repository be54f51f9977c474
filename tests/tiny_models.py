"""Tiny random models and a locally trained tokenizer, built on the spot (no model hub).

build_tiny_model(tmp_dir, arch) writes a checkpoint folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a ChatML template) that stepahead and transformers
both load.
"""

from __future__ import annotations

import functools
import json
import sysconfig
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 2048

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3")
GEMMA_ARCHS = ("gemma2", "gemma3")
MOE_ARCHS = ("qwen3_moe", "mixtral")


def _training_text() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:40]
    return [f.read_text(errors="ignore") for f in files]


@functools.lru_cache(maxsize=4)
def _trained_tokenizer(marker_tokens: tuple[str, ...] = ()) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS + list(marker_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    return tok.to_str()


def _tokenizer_json(marker_tokens: tuple[str, ...], special: bool) -> str:
    spec = json.loads(_trained_tokenizer(marker_tokens))
    for added in spec["added_tokens"]:
        if added["content"] in marker_tokens:
            added["special"] = special  # ordinary, as Qwen's <think> (decoding keeps it), or special
    return json.dumps(spec)


def write_tokenizer(folder: Path, marker_tokens: tuple[str, ...] = (), special: bool = False) -> None:
    """marker_tokens: format markers (`<think>`, `<tool_call>`) the tokenizer holds as single tokens, within
    the same vocabulary size, for the parsers that need them (entrypoints/openai/parser_tokens.py): ordinary
    added tokens, or special ones (as Magistral's [THINK]: decoding skips them unless told not to)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(_tokenizer_json(tuple(marker_tokens), special))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
    }))
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))


def tiny_config(arch: str = "llama", **overrides):
    import transformers

    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=2, pad_token_id=0,
    )
    common.update(overrides)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "mistral":
        return transformers.MistralConfig(**{"sliding_window": None, **common})
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **common)
    if arch == "phi3":  # Phi-4-mini's shape of rope: 3/4 of each head rotates
        common.setdefault("partial_rotary_factor", 0.75)
        common.setdefault("sliding_window", None)
        return transformers.Phi3Config(**common)
    if arch in GEMMA_ARCHS:
        return _gemma_config(arch, common)
    if arch == "qwen3_moe":  # 8 experts, the middle layer dense (mlp_only_layers)
        moe = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   mlp_only_layers=[1], norm_topk_prob=False, decoder_sparse_step=1)
        cfg = {**common, **moe, **overrides}
        cfg["mlp_only_layers"] = list(cfg["mlp_only_layers"])  # a tuple in overrides, which must hash
        return transformers.Qwen3MoeConfig(head_dim=16, **cfg)
    if arch == "mixtral":
        moe = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)
        return transformers.MixtralConfig(sliding_window=None, **{**common, **moe, **overrides})
    raise ValueError(f"unknown tiny arch {arch!r}")


def phi3_longrope(original: int = 128) -> dict:
    """tiny_config("phi3") overrides for LongRoPE: an original context of `original` positions stretched
    4x, random short (about 1) and long (2-9) factors over the 6 frequencies of 3/4 of a 16-wide head."""
    import random

    rng = random.Random(1)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [round(rng.uniform(1.0, 1.5), 3) for _ in range(6)],
            "long_factor": [round(rng.uniform(2.0, 9.0), 3) for _ in range(6)]}
    return dict(rope_parameters=rope, original_max_position_embeddings=original, max_position_embeddings=4 * original)


def _gemma_config(arch: str, common: dict):
    """A windowed layer then a global one; a window shorter than the test prompts, and an attention
    logit cap that bites once _sharpen has made the scores large."""
    import transformers

    gemma = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=True,
                 hidden_activation="gelu_pytorch_tanh")
    gemma.update(common)
    gemma["tie_word_embeddings"] = True  # as Gemma checkpoints are
    if arch == "gemma2":
        gemma.setdefault("attn_logit_softcapping", 1.5)
        gemma.setdefault("final_logit_softcapping", 3.0)
        return transformers.Gemma2Config(**gemma)
    gemma.setdefault("rope_parameters", {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    })
    gemma.setdefault("layer_types", ["sliding_attention", "full_attention"] * (gemma["num_hidden_layers"] // 2))
    gemma.setdefault("final_logit_softcapping", 3.0)
    return transformers.Gemma3TextConfig(**gemma)


def _sharpen(model) -> None:
    """Gemma's norm weights are offsets from 1 and start at 0: draw them, and scale q and k up, so
    that (1 + w), the logit caps and the window each change the greedy ids when got wrong."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(8.0)


def build_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random model of the given family, with the local tokenizer, into folder."""
    import torch
    import transformers

    folder = Path(folder)
    if (folder / "model.safetensors").exists():
        return folder
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    if arch in GEMMA_ARCHS:
        _sharpen(model)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


def build_scripted_model(folder: Path, successors: dict[int, int], marker_tokens: tuple[str, ...] = ()) -> Path:
    """A tiny Llama that says a fixed text: a bigram model whose greedy next token after `a` is
    successors[a]. Every layer adds nothing to the residual stream (o_proj and down_proj are zero), so
    the last hidden state is the token's own embedding, and the head scores b by the normalized
    embedding of its predecessor (random 64-wide embeddings are near orthogonal: a margin of tens of
    logits). Chain the successors to script an output; after a token without one the logits are near
    zero, so a grammar there chooses among equals. marker_tokens: as write_tokenizer's."""
    import torch
    import transformers

    folder = Path(folder)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = model.model.embed_tokens.weight
        head = torch.zeros_like(model.lm_head.weight)
        for a, b in successors.items():
            head[b] = 10.0 * embeddings[a] / embeddings[a].norm()
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)
    write_tokenizer(folder, marker_tokens)
    return folder


def llm_greedy(folder: Path, prompts: list[list[int]], max_tokens: int, **engine) -> list[list[int]]:
    """stepahead's greedy token ids through LLM (in-process executor), for comparison with hf_greedy."""
    from stepahead import LLM, SamplingParams

    with LLM(str(folder), executor="uni", **engine) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: transformers' greedy generate in float32, one prompt at a time (no padding effects)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def hf_logits(folder: Path, ids: list[int]):
    """Reference: transformers' float32 logits [len(ids), vocab] of one forward pass over ids."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_prompt_logprobs(folder: Path, prompts: list[list[int]], top_k: int) -> list[list[dict[int, tuple[float, int]] | None]]:
    """Reference prompt logprobs from one transformers float32 forward per prompt: per position None
    (the first) or token id -> (logprob, 1-based rank), for the prompt token and the top_k."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    result = []
    with torch.no_grad():
        for ids in prompts:
            lp = model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
            positions: list[dict[int, tuple[float, int]] | None] = [None]
            for p in range(1, len(ids)):
                row, target = lp[p - 1], ids[p]
                entries = {target: (row[target].item(), int((row > row[target]).sum()) + 1)}
                values, top = row.topk(top_k) if top_k else (torch.empty(0), torch.empty(0, dtype=torch.long))
                for rank, (token_id, value) in enumerate(zip(top.tolist(), values.tolist(), strict=True), start=1):
                    entries.setdefault(token_id, (value, rank))
                positions.append(entries)
            result.append(positions)
    return result
