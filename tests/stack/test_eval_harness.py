"""An evaluation harness pointed at the OpenAI-compatible endpoint: lm-eval's
``local-completions`` model (unmodified, lm-eval 0.4) runs a multiple-choice task (loglikelihood:
``/v1/completions`` with ``echo`` and ``logprobs``) and a generation task (``generate_until``:
``/v1/completions`` with ``stop``) on the tiny model, from local task files (no dataset download).

The numbers lm-eval reports are checked against the gateway's own answers: each choice's
loglikelihood equals the sum of the continuation's ``token_logprobs`` from a direct echo request,
and each generation equals a direct greedy completion.

Two ways to run it (as tests/stack/test_compat_sdk.py): ``scripts/test-eval-harness.sh`` makes a
venv ``.venv-eval`` with ``lm-eval[api]`` (whose dependencies pin ``python-dateutil<3``, which the
main venv's ``kubernetes`` refuses) and runs this file with ``--noconftest`` against ``openrl
serve``, with ``OPENRL_EVAL_BASE_URL``, ``OPENRL_EVAL_API_KEY`` and ``OPENRL_EVAL_TOKENIZER`` set;
in the main suite it runs against the ``stack`` fixture when ``lm_eval`` is importable and is
skipped otherwise. So it imports nothing from openrl or conftest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed here: scripts/test-eval-harness.sh runs this file")

BASE_MODEL = "Qwen/Qwen3-4B-Instruct-2507"
QUESTIONS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five"], "answer": 0},
    {"question": "The sky is", "choices": [" blue", " green", " made of cheese"], "answer": 0},
]


@pytest.fixture(scope="module")
def target(request) -> tuple[str, str, str]:
    """(base_url, api_key, tokenizer dir): the server named by the environment, else the ``stack`` fixture."""
    url = os.environ.get("OPENRL_EVAL_BASE_URL")
    if url:
        return url, os.environ["OPENRL_EVAL_API_KEY"], os.environ["OPENRL_EVAL_TOKENIZER"]
    stack = request.getfixturevalue("stack")
    return stack.base_url, stack.api_key, str(Path(stack.state_dir) / "models" / "tiny-qwen3")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    data = d / "qa.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (d / "mc.yaml").write_text(
        "task: openrl_tiny_mc\n" + common + "output_type: multiple_choice\ntarget_delimiter: ''\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    (d / "gen.yaml").write_text(
        "task: openrl_tiny_gen\n" + common + "output_type: generate_until\n"
        "doc_to_text: '{{question}}'\ndoc_to_target: '{{choices[answer]}}'\n"
        "generation_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 5\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")
    return d


def test_lm_eval_local_completions_scores_match_the_endpoint(target, tasks, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    base_url, key, tok_dir = target
    monkeypatch.setenv("OPENAI_API_KEY", key)  # what local-completions sends as the bearer token
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = simple_evaluate(
        model="local-completions",
        model_args=f"model={BASE_MODEL},base_url={base_url}/v1/completions,tokenizer={tok_dir},"
                   "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1",
        tasks=["openrl_tiny_mc", "openrl_tiny_gen"], task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    acc = out["results"]["openrl_tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert "exact_match,remove_whitespace" in out["results"]["openrl_tiny_gen"] or \
        any(k.startswith("exact_match") for k in out["results"]["openrl_tiny_gen"])

    tok = AutoTokenizer.from_pretrained(tok_dir)
    http = httpx.Client(base_url=base_url + "/v1", headers={"Authorization": f"Bearer {key}"}, timeout=300)
    mc = out["samples"]["openrl_tiny_mc"]
    assert len(mc) == len(QUESTIONS)
    for s in mc:
        q = s["doc"]
        for choice, resp in zip(q["choices"], s["resps"]):
            ctx = tok.encode(q["question"], add_special_tokens=False)
            cont = tok.encode(choice, add_special_tokens=False)
            r = http.post("/completions", json={"model": BASE_MODEL, "prompt": ctx + cont, "max_tokens": 0,
                                                "echo": True, "logprobs": 1})
            assert r.status_code == 200, r.text
            want = sum(r.json()["choices"][0]["logprobs"]["token_logprobs"][len(ctx):])
            assert resp[0][0] == pytest.approx(want, abs=1e-4)
    for s in out["samples"]["openrl_tiny_gen"]:
        r = http.post("/completions", json={"model": BASE_MODEL, "prompt": s["doc"]["question"], "max_tokens": 5,
                                            "temperature": 0, "stop": ["\n\n"]})
        assert s["resps"][0][0] == r.json()["choices"][0]["text"]
