"""GET /tokenizer_info (--enable-tokenizer-info-endpoint): the tokenizer's configuration as its
tokenizer_config.json would hold it, with the class, the chat template and the added tokens, for clients
that tokenize on their side (vLLM serves the same)."""

from __future__ import annotations

from typing import Any

_SCALARS = (str, int, float, bool, type(None))


def _plain(value: Any) -> Any:
    """JSON form of a configuration value; a token object becomes its text; what has no JSON form, None."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    content = getattr(value, "content", None)  # tokenizers' AddedToken
    return content if isinstance(content, str) else None


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    info = {name: _plain(value) for name, value in getattr(tokenizer, "init_kwargs", {}).items()
            if not name.startswith("_") and name not in ("tokenizer_file", "name_or_path", "vocab_file")}
    info["tokenizer_class"] = type(tokenizer).__name__
    info["model_max_length"] = int(tokenizer.model_max_length)
    info["chat_template"] = getattr(tokenizer, "chat_template", None)
    info["added_tokens_decoder"] = {
        str(token_id): {"content": token.content, "special": bool(token.special), "lstrip": bool(token.lstrip),
                        "rstrip": bool(token.rstrip), "normalized": bool(token.normalized),
                        "single_word": bool(token.single_word)}
        for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    return info
