"""Offline generation with minicore's LLM API on the default model (SmolLM2-135M-Instruct).

Run: .venv/bin/python examples/offline_generate.py
"""

from minicore import LLM, SamplingParams


def main() -> None:
    llm = LLM(max_model_len=1024)
    greedy = SamplingParams(max_tokens=64, temperature=0)
    questions = ["What is the capital of France?", "Give me three tips for writing clean Python.",
                 "Explain what a KV cache is in one sentence."]
    for out in llm.chat([[{"role": "user", "content": q}] for q in questions], greedy):
        print(f"Q: {out.prompt.splitlines()[-3]}\nA: {out.outputs[0].text}\n")

    sampled = SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=1)
    for out in llm.generate(["Once upon a time", "The best thing about the sea is"], sampled):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")


if __name__ == "__main__":
    main()
