"""A real evaluation client against a real server: lm-eval's `local-completions` model (what
vLLM users run as `lm_eval --model local-completions --model_args base_url=.../v1/completions`)
scores a small multiple-choice task, defined here from a local JSON file, against
`python -m minicore serve` on the default model. Each choice's log-likelihood comes from the
completions endpoint with echo=True and logprobs=1 (prompt logprobs), sent as token ids in
batches; they must equal the same sum computed directly with transformers to 1e-4, and lm-eval's
accuracy must be the one those sums give. Skipped when lm_eval is not installed (the test extra
installs it)."""

import json

import httpx
import pytest
from server_helpers import ServerProcess

lm_eval = pytest.importorskip("lm_eval")

pytestmark = pytest.mark.model

TASK = "minicore_mc"
# (question, choices, index of the right one): plain facts a 135M model mostly gets right, with
# choices of different token lengths so that sums over several continuation tokens are compared.
DOCS = [
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("Two plus two equals", ["three", "four", "five"], 1),
    ("The opposite of hot is", ["cold", "warm", "boiling water"], 0),
    ("Water freezes at zero degrees", ["Celsius", "Fahrenheit", "Kelvin"], 0),
    ("The largest planet in the solar system is", ["Jupiter", "Mars", "Mercury"], 0),
    ("A week has seven", ["days", "hours", "months"], 0),
    ("The color of the sky on a clear day is", ["green", "blue", "red"], 1),
    ("Cats are animals that say", ["woof", "meow", "moo"], 1),
]
TOLERANCE = 1e-4


def _write_task(directory) -> None:
    """lm-eval's task YAML (dataset_path json + data_files: no download) and its JSON lines."""
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in DOCS))
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], int]:
    """(context + continuation token ids, number of context tokens), as lm-eval's
    TemplateLM._encode_pair: the context's trailing spaces move to the continuation, and the
    continuation is what the whole adds to the context's tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    return whole, len(tokenizer(context, add_special_tokens=False).input_ids)


def _reference(model, tokenizer, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
    """For each (context, continuation): the continuation's log-likelihood and whether each of
    its tokens is the argmax, from one right-padded transformers forward over all pairs (causal
    attention: padding on the right changes no real position)."""
    import torch

    encoded = [_encode_pair(tokenizer, *pair) for pair in pairs]
    width = max(len(whole) for whole, _ in encoded)
    ids = torch.tensor([whole + [0] * (width - len(whole)) for whole, _ in encoded])
    mask = torch.tensor([[1] * len(whole) + [0] * (width - len(whole)) for whole, _ in encoded])
    from minicore.model.attention import attn_implementation

    # The session's model may have been switched to minicore's paged attention by an LLM test.
    with torch.no_grad(), attn_implementation(model, "sdpa"):
        logprobs = torch.log_softmax(model(ids, attention_mask=mask).logits.float(), dim=-1)
    results = []
    for (whole, n_context), row in zip(encoded, logprobs):
        target = torch.tensor(whole[n_context:])
        steps = row[n_context - 1:len(whole) - 1]
        results.append((steps.gather(1, target[:, None]).sum().item(),
                        bool((steps.argmax(-1) == target).all())))
    return results


def test_lm_eval_local_completions_log_likelihoods_match_transformers(
        tmp_path, monkeypatch, hf_model_and_tokenizer):
    from lm_eval.tasks import TaskManager

    from minicore.model.loader import resolve_model_dir

    # The task's data is a local file; nothing may reach for the hub.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    _write_task(tmp_path)
    with ServerProcess("--max-model-len", "512", "--max-num-seqs", "8") as server:
        (model_card,) = httpx.get(server.url + "/v1/models").json()["data"]
        model_args = {
            "base_url": server.url + "/v1/completions", "model": model_card["id"],
            "tokenizer_backend": "huggingface", "tokenizer": str(resolve_model_dir()),
            "tokenized_requests": True, "batch_size": 4, "max_retries": 1,
        }
        # include_defaults=False: indexing lm-eval's built-in tasks alone costs ~20 s; no
        # bootstrap: the standard error is not checked.
        results = lm_eval.simple_evaluate(
            model="local-completions", model_args=model_args, tasks=[TASK],
            task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
            log_samples=True, bootstrap_iters=0)
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    pairs = [tuple(arguments) for sample in samples for arguments in sample["arguments"]]
    reference = iter(_reference(*hf_model_and_tokenizer, pairs))
    right = 0
    for sample in samples:
        got = [tuple(r) for r in sample["filtered_resps"]]
        want = [next(reference) for _ in sample["arguments"]]
        assert len(got) == len(DOCS[sample["doc_id"]][1])
        for (got_ll, got_greedy), (want_ll, want_greedy) in zip(got, want):
            assert got_ll == pytest.approx(want_ll, abs=TOLERANCE), (sample["arguments"], got, want)
            assert got_greedy == want_greedy, (sample["arguments"], got, want)
        lls = [ll for ll, _ in want]
        right += lls.index(max(lls)) == sample["target"]
    assert results["results"][TASK]["acc,none"] == pytest.approx(right / len(DOCS))
