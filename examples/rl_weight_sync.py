"""An RL weight sync, as verl or OpenRLHF drive vLLM: pause generation, load the trainer's new
weights in place on every worker, drop the stale prefix cache, resume; greedy outputs then equal
transformers' with the new weights.

Offline, on an in-process engine (collective_rpc runs a function on the model runner):

    .venv/bin/python examples/rl_weight_sync.py

Against a server started with the development endpoints (any --data-parallel-size; over HTTP
the weight update's three calls load a safetensors file on every rank):

    VLLM_SERVER_DEV_MODE=1 .venv/bin/python -m minicore serve --dtype float32 --data-parallel-size 2
    .venv/bin/python examples/rl_weight_sync.py --base-url http://127.0.0.1:8000

The "trainer" here is a perturbation of the default model's MLP weights, saved as a safetensors
file; the example prints the outputs before and after and exits 1 if they do not match
transformers' with the new weights.
"""

import argparse
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a dragon"]
MAX_TOKENS = 24


def default_model_dir() -> str:
    from minicore.config import create_engine_config
    from minicore.engine.launch import resolve_model

    return resolve_model(create_engine_config()).model_config.model


def trainer_step(model, path: Path) -> None:
    """The new weights: every MLP down projection scaled by a seeded 1 +- 20% per element."""
    generator = torch.Generator().manual_seed(0)
    new = {name: (p.detach() * (1 + 0.2 * torch.randn(p.shape, generator=generator))).contiguous()
           for name, p in model.named_parameters() if name.endswith("mlp.down_proj.weight")}
    save_file(new, str(path))


def transformers_agrees(model, tokenizer, completions: list) -> list[bool]:
    """For each prompt's completion: is every token transformers' greedy pick (its argmax given
    the tokens before it)? Then it is what transformers' generate would give, barring exact ties,
    for one forward per completion instead of generate's one per token."""
    agrees = []
    for prompt, tokens in zip(PROMPTS, completions):
        ids = tokenizer(prompt).input_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids + list(tokens)[:-1]])).logits[0, len(ids) - 1:]
        agrees.append(logits.argmax(dim=-1).tolist() == list(tokens))
    return agrees


def load_weights_in_place(runner, path: str) -> int:
    """Runs on the model runner (collective_rpc): copy the file's tensors into the parameters;
    returns how many."""
    params, tensors = dict(runner.model.named_parameters()), load_file(path)
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor)
    runner.bind_weights()  # the CPU linear layers take the new tensors
    return len(tensors)


def sync_offline(model_dir: str, path: Path) -> tuple[list, list]:
    from minicore import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", max_model_len=512)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.pause_generation()
    print("collective_rpc:", llm.collective_rpc(load_weights_in_place, args=(str(path),)))
    llm.reset_prefix_cache()
    llm.resume_generation()
    after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    return before, after


def sync_server(base_url: str, tokenizer, path: Path) -> tuple[list, list]:
    import httpx

    def complete() -> list[list[int]]:
        """The prompts' greedy completions, all at once, as a rollout sends them: the server
        batches them (and spreads them over its DP ranks)."""
        model = http.get("/v1/models").json()["data"][0]["id"]

        def one(prompt: str) -> str:
            return http.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}).json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(one, PROMPTS))
        return [tokenizer(text, add_special_tokens=False).input_ids for text in texts]

    with httpx.Client(base_url=base_url, timeout=120) as http:
        before = complete()
        update_info = {"update_info": {"path": str(path)}}
        for call in (lambda: http.post("/pause", params={"mode": "keep"}),
                     lambda: http.post("/start_weight_update"),
                     lambda: http.post("/update_weights", json=update_info),
                     lambda: http.post("/finish_weight_update"),
                     lambda: http.post("/reset_prefix_cache"),
                     lambda: http.post("/resume")):
            response = call()
            response.raise_for_status()
            print(response.request.url.path, response.text)
        return before, complete()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", help="a server with VLLM_SERVER_DEV_MODE=1 (default: offline)")
    ap.add_argument("--model", help="the model directory (default: the default model's)")
    args = ap.parse_args()
    from minicore.model.loader import load_model

    model_dir = args.model or default_model_dir()
    model, tokenizer = load_model(model_dir, dtype="float32", device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "new_weights.safetensors"
        trainer_step(model, path)
        before, after = (sync_server(args.base_url, tokenizer, path) if args.base_url
                         else sync_offline(model_dir, path))
        model.load_state_dict(load_file(str(path)), strict=False)
    agrees_after = transformers_agrees(model, tokenizer, after)
    for prompt, old, new, agrees in zip(PROMPTS, before, after, agrees_after):
        verdict = "equals" if agrees else "DIFFERS FROM"
        print(f"{prompt!r}\n  before: {tokenizer.decode(old)!r}\n  after:  "
              f"{tokenizer.decode(new)!r}\n  {verdict} transformers with the new weights")
    # And the old outputs are not the new weights' (the update changed something).
    ok = all(agrees_after) and not all(transformers_agrees(model, tokenizer, before))
    print("weight sync:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
