"""lm-evaluation-harness against a real ``scripts/serve.py`` (slow): ``lm_eval --model
local-completions --model_args base_url=...,tokenizer_backend=remote`` runs a loglikelihood
(multiple-choice) task and a ``generate_until`` task from small local JSON files with no
other set-up (it reads ``/tokenizer_info``, then tokenizes through ``/tokenize``), and its
context/choice scores equal direct ``echo`` calls on the same token ids.

lm-eval is not a test dependency: the test finds the ``lm_eval`` executable through
``$PAXCACHE_LM_EVAL`` or ``PATH`` (e.g. ``pip install "lm-eval[api]"`` into its own venv) and
skips when there is none.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import httpx
import pytest
from serve_process import serve_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # warm-up: minutes on a busy CPU

LM_EVAL = os.environ.get("PAXCACHE_LM_EVAL") or shutil.which("lm_eval")

MC_DOCS = [
    {"question": "The cat sat on the", "choices": [" mat", " moon", " dog"], "answer": 0},
    {"question": "One, two,", "choices": [" three", " four"], "answer": 0},
    {"question": "Hello", "choices": [" world", "!", " there, friend"], "answer": 1},
]
GEN_DOCS = [{"question": "Q: say hi\nA:", "answer": " hi"}, {"question": "abc", "answer": "d"}]

MC_TASK = """task: paxcache_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: paxcache_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def _write_tasks(root) -> None:
    for name, docs, task in (("mc", MC_DOCS, MC_TASK), ("gen", GEN_DOCS, GEN_TASK)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (root / f"{name}.yaml").write_text(task.format(data=data))


def _samples(out_dir, task: str) -> list[dict]:
    (path,) = list(out_dir.rglob(f"samples_{task}_*.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _arguments(sample: dict) -> list[tuple]:
    """A logged sample's request arguments: ``{"gen_args_0": {"arg_0": ..., "arg_1": ...}}``
    as lm-eval 0.4 writes them (or a plain list of argument lists)."""
    args = sample["arguments"]
    if isinstance(args, list):
        return [tuple(a) for a in args]
    order = sorted(args, key=lambda k: int(k.rsplit("_", 1)[1]))
    return [tuple(args[k][f"arg_{j}"] for j in range(len(args[k]))) for k in order]


def _echo_score(base: str, model: str, context: str, continuation: str) -> float:
    """Sum of the continuation's token logprobs, as lm-eval sends it: the token ids of context
    and continuation (no BOS: token-id prompts are fed as sent), echoed."""

    def ids(text: str) -> list[int]:
        r = httpx.post(f"{base}/tokenize", json={"prompt": text, "add_special_tokens": False})
        return r.json()["tokens"]

    ctx, cont = ids(context), ids(continuation)
    body = {"model": model, "prompt": ctx + cont, "max_tokens": 1, "echo": True, "logprobs": 1}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    return sum(lps[len(ctx) : len(ctx) + len(cont)])


@pytest.mark.skipif(LM_EVAL is None, reason="lm_eval not installed ($PAXCACHE_LM_EVAL or PATH)")
def test_lm_eval_remote_tokenizer_scores_equal_direct_echo_calls(tmp_path):
    _write_tasks(tmp_path)
    args = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--no-structured-warmup"]
    with serve_process(*args) as (base, _):
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        model_args = f"model={model},base_url={base}/v1/completions,tokenizer_backend=remote"
        cmd = [LM_EVAL, "--model", "local-completions", "--model_args", model_args]
        cmd += ["--tasks", "paxcache_tiny_mc,paxcache_tiny_gen", "--include_path", str(tmp_path)]
        cmd += ["--output_path", str(tmp_path / "out"), "--log_samples"]
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OPENAI_API_KEY="x")
        env.pop("PYTHONPATH", None)
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
        assert run.returncode == 0, run.stderr[-4000:]
        mc = _samples(tmp_path / "out", "paxcache_tiny_mc")
        assert len(mc) == len(MC_DOCS)
        checked = 0
        for sample in mc:
            for (context, continuation), resp in zip(
                _arguments(sample), sample["resps"], strict=True
            ):
                got = float(resp[0][0])
                assert got == pytest.approx(
                    _echo_score(base, model, context, continuation), abs=1e-4
                )
                checked += 1
        assert checked == sum(len(d["choices"]) for d in MC_DOCS)
        gen = _samples(tmp_path / "out", "paxcache_tiny_gen")
        assert len(gen) == len(GEN_DOCS) and all(isinstance(s["resps"][0][0], str) for s in gen)
