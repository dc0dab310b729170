"""Talk to a running `python -m minicore serve` with the official openai package.

Start the server first (it loads the default SmolLM2-135M-Instruct):

    .venv/bin/python -m minicore serve --port 8000
    .venv/bin/python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1] [--api-key KEY]

It lists the served model, then asks for a chat completion, a plain completion, and a streamed
chat completion, printing the tokens as they arrive and the usage the server reports.
"""

import argparse

from openai import OpenAI


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="EMPTY", help="the server's --api-key, if it has one")
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    print(f"model: {model}\n")

    chat = client.chat.completions.create(
        model=model, temperature=0, max_tokens=64,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    print("chat:", chat.choices[0].message.content)
    print(f"      finish_reason={chat.choices[0].finish_reason}, usage={chat.usage}\n")

    completion = client.completions.create(model=model, prompt="The three primary colours are",
                                           max_tokens=32, temperature=0, stop=["\n"])
    print("completion:", completion.choices[0].text)
    print(f"            finish_reason={completion.choices[0].finish_reason}\n")

    print("streamed chat: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model, max_tokens=96, temperature=0.7, seed=0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Write a haiku about the sea."}])
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            print(f"\n\nusage: {chunk.usage}")


if __name__ == "__main__":
    main()
