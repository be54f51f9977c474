"""Speculative decoding on the worker: proposers that draft tokens after sampling, and the verification
that keeps the drafts the target model agrees with (docs/design.md, "Draft tokens as placeholders")."""
