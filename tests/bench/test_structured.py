"""`stepahead bench structured` end to end on the built-in model (real grammars, real engines)."""

from __future__ import annotations

import json

from stepahead.entrypoints.cli import main


def test_structured_against_unconstrained_writes_json(tmp_path, capsys):
    out = tmp_path / "structured.json"
    rc = main(["bench", "structured", "--num-prompts", "4", "--max-tokens", "24", "--rounds", "2",
               "--max-model-len", "256", "--json", str(out)])
    assert rc == 0
    assert "async/sync structured" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["benchmark"] == "structured" and len(data["rows"]) == 4
    assert sorted(r["mode"] for r in data["rows"]) == ["async", "async", "sync", "sync"]
    tokens = {r["output_tokens"] for r in data["rows"]}
    assert len(tokens) == 1 and tokens.pop() > 0  # greedy: the same outputs in every mode and round
    for row in data["rows"]:
        assert row["structured_tok_s"] > 0 and row["unconstrained_tok_s"] > 0
        assert row["fill_ms_per_step"] > 0 and row["apply_ms_per_step"] > 0  # from the trace's grammar events
    assert data["summary"]["async"]["ratio"] > 0
