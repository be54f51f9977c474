"""Speculative decoding's acceptance over a benchmark run, from a server's /metrics before and after
(as `vllm bench serve` reports it): drafts, accepted drafts, the mean accepted length."""

from __future__ import annotations

COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def scrape(base_url: str, headers: dict) -> dict[str, float] | None:
    """The server's speculative-decoding counters, or None when it has no /metrics or they are absent."""
    import httpx

    try:
        response = httpx.get(f"{base_url}/metrics", headers=headers, timeout=30.0)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse(response.text)


def parse(text: str) -> dict[str, float] | None:
    """The counters from Prometheus text (any prefix before the colon), or None when one is absent."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.split(":", 1)[-1]
        if name in COUNTERS:
            found[name] = sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
    return found if len(found) == len(COUNTERS) else None


def acceptance(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """The run's drafts, draft and accepted tokens and mean accepted length; None without drafting."""
    if before is None or after is None:
        return None
    delta = {name: after[name] - before[name] for name in COUNTERS}
    drafts = delta["spec_decode_num_drafts"]
    if drafts <= 0:
        return None
    return {"spec_num_drafts": drafts, "spec_num_draft_tokens": delta["spec_decode_num_draft_tokens"],
            "spec_num_accepted_tokens": delta["spec_decode_num_accepted_tokens"],
            "spec_mean_accepted_length": 1 + delta["spec_decode_num_accepted_tokens"] / drafts}
