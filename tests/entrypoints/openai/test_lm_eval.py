"""lm-evaluation-harness's `local-completions` model against the server, on a small multiple-choice task
kept in this folder (lm_eval_task/: JSON lines and the task's YAML; no downloads): its accuracy and its
per-choice loglikelihoods equal the same task scored offline from LLM.generate's prompt logprobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stepahead import LLM, SamplingParams
from tests.entrypoints.openai.conftest import MODEL_NAME

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = "stepahead_tiny_mc"


def _docs() -> list[dict]:
    return [json.loads(line) for line in (TASK_DIR / "tiny_mc.jsonl").read_text().splitlines() if line]


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split for causal models: trailing spaces of the context move to the continuation, the
    whole is encoded once, and the continuation is what follows the context's own encoding."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids):]


def _offline_scores(model: Path) -> tuple[float, list[list[float]]]:
    """Accuracy and each choice's loglikelihood from the prompt logprobs of context + choice."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    docs = _docs()
    pairs = [_encode_pair(tokenizer, doc["question"], " " + choice) for doc in docs for choice in doc["choices"]]
    with LLM(str(model), executor="uni", dtype="float32", max_model_len=512) as llm:
        outs = llm.generate([{"prompt_token_ids": ctx + cont} for ctx, cont in pairs],
                            SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
    scores = []
    for (ctx, cont), out in zip(pairs, outs, strict=True):
        ids, lps = out.prompt_token_ids, out.prompt_logprobs
        scores.append(sum(lps[p][ids[p]].logprob for p in range(len(ctx), len(ctx) + len(cont))))
    per_doc, k = [], 0
    for doc in docs:
        per_doc.append(scores[k:k + len(doc["choices"])])
        k += len(doc["choices"])
    correct = [max(range(len(s)), key=s.__getitem__) == doc["answer"] for s, doc in zip(per_doc, docs, strict=True)]
    return sum(correct) / len(correct), per_doc


def test_lm_eval_local_completions_matches_offline(server, tiny_llama, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is in the dev extras")
    out_dir = tmp_path / "results"
    model_args = (f"model={MODEL_NAME},base_url={server.base_url}/completions,tokenizer={tiny_llama},"
                  "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,max_length=512")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "HF_HOME": str(tmp_path / "hf"),
           "PYTHONPATH": str(Path(__file__).parents[3])}
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
         "--tasks", TASK, "--include_path", str(TASK_DIR), "--output_path", str(out_dir), "--log_samples",
         "--batch_size", "4"],
        cwd=TASK_DIR, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (results_file,) = out_dir.rglob("results_*.json")
    accuracy = json.loads(results_file.read_text())["results"][TASK]["acc,none"]
    (samples_file,) = out_dir.rglob(f"samples_{TASK}_*.jsonl")
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines() if line),
                     key=lambda s: s["doc_id"])

    offline_accuracy, offline_scores = _offline_scores(tiny_llama)
    assert accuracy == offline_accuracy
    assert len(samples) == len(offline_scores)
    for sample, scores in zip(samples, offline_scores, strict=True):
        served = [float(resp[0][0]) for resp in sample["resps"]]
        assert served == pytest.approx(scores, abs=1e-3)
