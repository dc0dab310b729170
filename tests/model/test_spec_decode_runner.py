"""The real ModelRunner (a tiny random Llama on CPU) verifying drafts: driven by hand-built
SchedulerOutputs whose requests carry right, wrong, partly right and no drafts, next to a request
in a chunked prefill, its greedy tokens equal those of a run without drafts token for token, and
so do its logprobs (one row per emitted token, the same values): the KV that rejected drafts
wrote is overwritten before anything reads it, through the per-request decode rows
(minicore/model/decode_kv.py) and through the gather alike."""

from dataclasses import dataclass, field

import pytest
import torch

from minicore.config import CacheConfig, EngineConfig
from minicore.model.attention import GatheredDecode
from minicore.model.config import ModelConfig
from minicore.model.decode_kv import DecodeKVBuffers, RowKV
from minicore.model.native import native_kernels
from minicore.model.runner import ModelRunner
from minicore.sampling_params import SamplingParams
from minicore.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from minicore.spec_decode.config import SpeculativeConfig

VOCAB, BLOCK, BLOCKS_PER_REQUEST, K = 96, 4, 24, 3
PROMPTS = {"a": [5, 17, 33, 8, 61, 2, 40], "b": [70, 3], "c": list(range(20, 33))}
NUM_TOKENS = 40  # tokens each request generates in the run without drafts


def tiny_llama():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def make_runner(spec: bool, decode: str = "gathered") -> ModelRunner:
    """decode: how decode attention reads keys: "gathered" from the paged cache, "rows" from
    per-request rows (in chunks of 8 positions, so that sequences span several) with the native
    kernel where it builds, "rows-torch" from them in torch: the paths without batch
    invariance, which is then off."""
    config = EngineConfig(model_config=ModelConfig(batch_invariant=False),
                          cache_config=CacheConfig(block_size=BLOCK,
                                                   num_blocks=1 + 3 * BLOCKS_PER_REQUEST),
                          speculative_config=SpeculativeConfig(method="ngram",
                                                               num_speculative_tokens=K)
                          if spec else None)
    runner = ModelRunner(config, tiny_llama(), None)
    kernel = native_kernels() if decode == "rows" else None
    runner.decode_attention = (GatheredDecode() if decode == "gathered" else
                               DecodeKVBuffers(runner.kv_caches, chunk_size=8, kernel=kernel))
    return runner


@dataclass
class Sequence:
    prompt: list[int]
    blocks: list[int]
    params: SamplingParams
    chunk: int | None  # most prompt tokens a step
    computed: int = 0
    outputs: list[int] = field(default_factory=list)
    logprobs: list[tuple[list[int], list[float], int]] = field(default_factory=list)
    sent: bool = False


class Driver:
    """Plays the scheduler for one runner: every request runs every step, its blocks reserved
    when it arrives; after a step, the rejected drafts lower num_computed_tokens."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.seqs: dict[str, Sequence] = {}

    def add(self, req_id: str, chunk: int | None = None) -> None:
        first = 1 + len(self.seqs) * BLOCKS_PER_REQUEST
        blocks = list(range(first, first + BLOCKS_PER_REQUEST))
        self.seqs[req_id] = Sequence(PROMPTS[req_id], blocks,
                                     SamplingParams(temperature=0, logprobs=3), chunk)

    def step(self, drafts: dict[str, list[int]]) -> None:
        new, cached, scheduled = [], CachedRequestData(), {}
        for req_id, seq in self.seqs.items():
            tokens = seq.prompt + seq.outputs
            scheduled[req_id] = min(len(tokens) - seq.computed, seq.chunk or len(tokens))
            scheduled[req_id] += len(drafts.get(req_id, []))
            if seq.sent:
                cached.req_ids.append(req_id)
                cached.new_block_ids.append([])
                cached.num_computed_tokens.append(seq.computed)
            else:
                new.append(NewRequestData(req_id, tokens, len(seq.prompt), seq.params, seq.blocks,
                                          seq.computed))
                seq.sent = True
        so = SchedulerOutput(new, cached, scheduled, sum(scheduled.values()), set(), set(),
                             scheduled_spec_decode_tokens=drafts)
        out = self.runner.execute_model(so)
        for req_id, num_scheduled in scheduled.items():
            seq, draft = self.seqs[req_id], drafts.get(req_id, [])
            sampled = out.sampled_token_ids[out.req_id_to_index[req_id]]
            assert not draft or 1 <= len(sampled) <= len(draft) + 1
            assert sampled[:-1] == draft[:len(sampled) - 1]
            # What was computed, less the rejected drafts (none when nothing was sampled).
            rejected = len(draft) + 1 - len(sampled) if sampled else 0
            seq.computed += num_scheduled - rejected
            seq.outputs += sampled
            lists = (out.logprobs or {}).get(req_id)
            assert (lists is None) == (not sampled)
            if lists is not None:
                assert len(lists.sampled_token_ranks) == len(sampled)
                seq.logprobs += zip(lists.logprob_token_ids, lists.logprobs,
                                    lists.sampled_token_ranks)
                assert [row[0] for row in lists.logprob_token_ids] == sampled


@pytest.fixture(scope="module")
def reference() -> dict[str, Sequence]:
    """The run without drafts, on the plain runner: all three requests from the first step."""
    driver = Driver(make_runner(spec=False))
    for req_id in PROMPTS:
        driver.add(req_id)
    for _ in range(NUM_TOKENS):
        driver.step({})
    return driver.seqs


def drafts_for(pattern: str, seq: Sequence, ref: Sequence) -> list[int]:
    """Drafts after seq's outputs so far: the reference's next K tokens ('right'), each shifted
    ('wrong'), the first right and the rest wrong ('half'), the first only ('one'), none."""
    nxt = ref.outputs[len(seq.outputs):len(seq.outputs) + K]
    wrong = [(t + 1) % VOCAB for t in nxt]
    return {"right": nxt, "wrong": wrong, "half": nxt[:1] + wrong[1:], "one": nxt[:1],
            "none": []}[pattern]


PATTERNS = ["right", "wrong", "none", "half", "wrong", "one", "none", "right"]


@pytest.mark.parametrize("decode", ["rows", "rows-torch", "gathered"])
def test_greedy_tokens_and_logprobs_equal_the_run_without_drafts(reference, decode):
    runner = make_runner(spec=True, decode=decode)
    plans = record_plans(runner)
    driver = Driver(runner)
    driver.add("a")
    driver.add("b")
    for step in range(14):
        if step == 2:
            driver.add("c", chunk=5)  # its prompt over 3 steps, beside the drafts
        drafts = {}
        for i, (req_id, seq) in enumerate(driver.seqs.items()):
            if seq.computed >= len(seq.prompt):  # decoding: its newest token is not computed
                drafts[req_id] = drafts_for(PATTERNS[(step + 3 * i) % len(PATTERNS)], seq,
                                            reference[req_id])
        drafts = {req_id: d for req_id, d in drafts.items() if d}
        driver.step(drafts)
    for req_id, seq in driver.seqs.items():
        ref = reference[req_id]
        assert seq.outputs == ref.outputs[:len(seq.outputs)], req_id
        for got, want in zip(seq.logprobs, ref.logprobs):
            assert got[0] == want[0] and got[2] == want[2]
            assert got[1] == pytest.approx(want[1], abs=1e-4)
    # The drafts did speed the requests up: right drafts gave K + 1 tokens in a step.
    assert len(driver.seqs["a"].outputs) > 14 + 4
    # Decode attention read as asked in every step, rows included after rejections.
    assert {type(plan) for plan in plans} == {GatheredDecode if decode == "gathered" else RowKV}


def record_plans(runner: ModelRunner) -> list:
    plans, plan = [], runner.decode_attention.plan

    def recording_plan(*args):
        plans.append(plan(*args))
        return plans[-1]

    runner.decode_attention.plan = recording_plan
    return plans


def test_the_runner_forgets_the_drafts_once_verified(reference):
    runner = make_runner(spec=True)
    driver = Driver(runner)
    driver.add("b")
    driver.step({})
    seq = driver.seqs["b"]
    driver.step({"b": drafts_for("half", seq, reference["b"])})
    state = runner.requests["b"]
    assert state.spec_token_ids == []
    assert state.token_ids == seq.prompt + seq.outputs
    assert seq.computed == len(state.token_ids) - 1  # all but its newest token


def test_seeded_sampling_with_drafts_repeats_on_a_fresh_runner(reference):
    """Random rows verify drafts with the seeded request's own generator: two runners give the
    same tokens for the same drafts (the greedy run's next tokens, which a low temperature
    mostly accepts)."""

    def run() -> list[int]:
        driver = Driver(make_runner(spec=True))
        driver.add("a")
        seq = driver.seqs["a"]
        seq.params = SamplingParams(temperature=0.3, seed=3, logprobs=1)
        driver.step({})
        for _ in range(8):
            driver.step({"a": drafts_for("right", seq, reference["a"])})
        return seq.outputs

    first = run()
    assert first == run()
    assert len(first) > 9  # some drafts were accepted
