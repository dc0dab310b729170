"""Method "mtp" without a model (minicore/spec_decode/mtp.py and the scheduler's side): vLLM's
older name deepseek_mtp, num_lookahead_tokens = k (0 for ngram), the lookahead slots allocated
past a step's tokens up to max_model_len, a prefix hit one block short (vLLM's
drop_eagle_block), and the engine's MTPDrafter handing the scheduler what the runner proposed,
for the requests now decoding only. The model's side is tests/model/test_mtp.py."""

import pytest

from minicore.spec_decode.config import SpeculativeConfig
from minicore.spec_decode.mtp import MTPDrafter
from minicore.testing import make_request, make_scheduler, step

MTP = SpeculativeConfig(method="deepseek_mtp", num_speculative_tokens=3)
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3)


def test_deepseek_mtp_is_mtp_with_k_lookahead_slots():
    assert (MTP.method, MTP.num_lookahead_tokens, MTP.use_eagle()) == ("mtp", 3, True)
    assert (NGRAM.num_lookahead_tokens, NGRAM.use_eagle()) == (0, False)
    with pytest.raises(ValueError, match="prompt_lookup_max is the ngram method's"):
        SpeculativeConfig(method="mtp", num_speculative_tokens=2, prompt_lookup_max=3)


@pytest.mark.parametrize("spec, blocks", [(NGRAM, 2), (MTP, 3)])
def test_a_step_allocates_the_lookahead_slots(spec, blocks):
    s = make_scheduler(speculative_config=spec, block_size=4, num_blocks=20)
    s.add_request(make_request("a", 7))
    step(s, {"a": 9})
    # 7 prompt tokens computed, 1 to compute: 8 slots, and 3 more for MTP's draft steps.
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1}
    assert len(s.kv_cache_manager.get_block_ids("a")) == blocks


def test_the_lookahead_slots_stop_at_max_model_len():
    s = make_scheduler(speculative_config=MTP, block_size=4, num_blocks=20, max_model_len=8)
    s.add_request(make_request("a", 6, max_tokens=2))
    step(s)
    assert len(s.kv_cache_manager.get_block_ids("a")) == 2  # 6 + 3 slots, but 8 at most
    s.schedule()
    assert len(s.kv_cache_manager.get_block_ids("a")) == 2


@pytest.mark.parametrize("spec, hit", [(NGRAM, 8), (MTP, 4)])
def test_a_prefix_hit_leaves_its_last_block_to_compute_again(spec, hit):
    """MTP's KV at a block's last position read the token after it, which the hit does not
    cover: that block is computed again."""
    s = make_scheduler(speculative_config=spec, block_size=4, num_blocks=20)
    s.add_request(make_request("a", list(range(10)), max_tokens=1))
    step(s)
    s.add_request(b := make_request("b", list(range(10)), max_tokens=1))
    out = step(s).out
    assert (b.num_cached_tokens, out.num_scheduled_tokens) == (hit, {"b": 10 - hit})


class _Runner:
    def __init__(self):
        self.drafts = {}

    def take_draft_token_ids(self):
        drafts, self.drafts = self.drafts, {}
        return drafts


def test_the_engine_takes_the_runners_drafts_for_the_decoding_requests():
    runner = _Runner()
    drafter = MTPDrafter(MTP, 64, runner)
    s = make_scheduler(speculative_config=MTP, max_num_batched_tokens=12,
                       enable_chunked_prefill=True)
    s.add_request(make_request("a", [5, 6, 7]))
    s.add_request(make_request("b", list(range(20, 40))))  # still prefilling after a step
    out = step(s, {"a": 9}).out
    runner.drafts = {"a": [1, 2, 3], "b": [4]}
    drafts = drafter.propose(s.requests, len(s.running), out)
    assert (drafts.req_ids, drafts.draft_token_ids) == (["a"], [[1, 2, 3]])
    assert runner.drafts == {}  # taken

