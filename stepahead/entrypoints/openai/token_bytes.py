"""A token's raw bytes, for the `bytes` field of chat logprobs.

Decoding one token alone gives U+FFFD for a token that holds part of a multi-byte character; OpenAI's
`bytes` is the token's own bytes, so a client can join them. Byte-level BPE tokenizers (GPT-2 style)
spell each byte as one printable character (`bytes_to_unicode`), SentencePiece ones with byte fallback
spell a lone byte `<0xNN>` and a space `▁`.
"""

from __future__ import annotations

import functools
import re

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: printable character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class TokenBytes:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        pre_tokenizer = getattr(backend, "pre_tokenizer", None) if backend is not None else None
        decoder = getattr(backend, "decoder", None) if backend is not None else None
        self._byte_level = "ByteLevel" in repr(pre_tokenizer) or "ByteLevel" in repr(decoder)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one instance per server, bounded
    def __call__(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self._tokenizer.all_special_ids:
            return piece.encode()
        match = _BYTE_PIECE.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if self._byte_level:
            decoder = _byte_decoder()
            if all(c in decoder for c in piece):
                return bytes(decoder[c] for c in piece)
        return piece.replace("▁", " ").encode()
