"""Serve with two data-parallel engines and watch the requests spread over both.

    .venv/bin/python examples/dp_serve.py [--runner simulated] [--num-requests 16]

It starts `python -m minicore serve --data-parallel-size 2 --balance-scheduling` (the default
SmolLM2-135M-Instruct, one replica per engine process; --runner simulated for a quick look with
made-up tokens) on free ports, sends concurrent chat requests with the openai package, prints each
answer, then the per-engine request counters of /metrics, and stops the server.
"""

import argparse
import asyncio
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from openai import AsyncOpenAI

QUESTIONS = ["What is the capital of {}?", "Name a famous dish from {}.",
             "What language is spoken in {}?", "Describe the flag of {} in one sentence."]
COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "India", "Italy", "Peru"]


def free_port(pair: bool = False) -> int:
    """A free port; with pair=True one whose next port is free too (the DP group's rendezvous
    takes --data-parallel-rpc-port, the engines' handshake the port after it)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if not pair:
                return port
            with socket.socket() as nxt:
                try:
                    nxt.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue


def wait_healthy(url: str, server: subprocess.Popen, log, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            sys.exit(f"the server exited with {server.returncode}:\n{log.read().decode()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return
        except OSError:  # not listening yet, or 503 while an engine starts
            time.sleep(0.5)
    sys.exit(f"the server was not healthy within {timeout} s")


async def ask_all(base_url: str, questions: list[str], max_tokens: int) -> list[str]:
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="EMPTY", max_retries=0, timeout=300)
    model = (await client.models.list()).data[0].id

    async def ask(question: str) -> str:
        chat = await client.chat.completions.create(
            model=model, temperature=0, max_tokens=max_tokens,
            messages=[{"role": "user", "content": question}])
        return chat.choices[0].message.content

    # All at once: the frontend sends each to the engine with the lowest 4 * waiting + running.
    return await asyncio.gather(*(ask(q) for q in questions))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runner", choices=["transformers", "simulated"], default="transformers")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "minicore", "serve", "--port", str(port),
           "--data-parallel-size", "2", "--balance-scheduling", "--runner", args.runner,
           "--data-parallel-rpc-port", str(free_port(pair=True)), "--max-num-seqs", "8",
           "--max-model-len", "1024", "--disable-uvicorn-access-log"]
    print("starting: python", " ".join(cmd[1:]), flush=True)
    with tempfile.TemporaryFile() as log:
        # Its own session: stopping it below reaches the engine processes too.
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            wait_healthy(url, server, log)
            questions = list(itertools.islice(
                itertools.cycle(q.format(c) for c in COUNTRIES for q in QUESTIONS),
                args.num_requests))
            t0 = time.monotonic()
            answers = asyncio.run(ask_all(url, questions, args.max_tokens))
            print(f"\n{len(answers)} answers in {time.monotonic() - t0:.1f} s\n")
            for question, answer in zip(questions, answers):
                print(f"Q: {question}\nA: {answer!r}\n")

            with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                metrics = r.read().decode()
            print("requests served, by engine:")
            for line in metrics.splitlines():
                if line.startswith("minicore:request_success_total"):
                    print(" ", line)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(server.pid, signal.SIGKILL)  # anything of it still alive
            except ProcessLookupError:
                pass
            server.wait()


if __name__ == "__main__":
    main()
