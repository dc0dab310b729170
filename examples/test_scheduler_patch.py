"""How to test a scheduler patch with minicore.testing: copy this file, put your class in, and
write what each step should decide. Run: .venv/bin/python -m pytest examples/test_scheduler_patch.py

The patch here is a KV watermark gate: WatermarkScheduler admits no waiting request while fewer
than `watermark` KV blocks are free, keeping them for the running requests' decode. It overrides
the hook vllm-ascend's balance gate uses (minicore/scheduler/balance.py). Every number below can
be worked out by hand: blocks of 4 tokens, 7 usable (block 0 is the null block), and the fake
model samples 1000, 1001, ... unless a step's script says otherwise.
tests/test_testing.py runs this file, so it stays in step with minicore.
"""

from minicore.scheduler import Scheduler
from minicore.testing import make_request, make_scheduler, step

EOS = 2


class WatermarkScheduler(Scheduler):
    # The components (logprobs, drafts, ...) pass through: the composition root chooses them.
    def __init__(self, *args, watermark: int = 4, **components):
        super().__init__(*args, **components)
        self.watermark = watermark

    def _admission_gated(self) -> bool:
        return self.kv_cache_manager.block_pool.get_num_free_blocks() < self.watermark


def start(cls, **kwargs):
    """a (10 tokens: 3 blocks) runs, then b (6 tokens: 2 blocks) joins; 2 blocks stay free."""
    s = make_scheduler(cls=cls, num_blocks=8, **kwargs)
    s.add_request(make_request("a", 10, max_tokens=3))
    st = step(s)
    assert st.scheduled == {"a": 10} and st.tokens == {"a": [1000]}
    assert st.num_free == 4 and st.block_ids == {"a": [1, 2, 3]}
    s.add_request(make_request("b", 6, eos_token_id=EOS))
    st = step(s)  # 4 free blocks: not below the watermark, so b is admitted
    assert st.scheduled == {"a": 1, "b": 6} and st.new == ["b"] and st.cached == ["a"]
    assert st.num_free == 2 and st.block_ids["b"] == [4, 5]
    return s


def test_watermark_holds_back_admission_until_blocks_are_free():
    s = start(WatermarkScheduler, watermark=4)
    s.add_request(make_request("c", 2))
    # 2 free blocks < 4: c waits, while a and b still decode. a reaches max_tokens and b samples
    # EOS (scripted for this step): both finish and give their 5 blocks back.
    st = step(s, {"b": EOS})
    assert st.scheduled == {"a": 1, "b": 1} and st.new == []
    assert st.finished == ["a", "b"] and st.tokens == {"a": [1002], "b": [EOS]}
    assert st.num_free == 7 and st.block_ids == {}
    st = step(s)  # 7 free blocks: the gate is open again
    assert st.scheduled == {"c": 2} and st.new == ["c"] and st.num_free == 6


def test_without_the_patch_c_is_admitted_at_once():
    s = start(Scheduler)
    s.add_request(make_request("c", 2))
    st = step(s, {"b": EOS})
    assert st.scheduled == {"a": 1, "b": 1, "c": 2} and st.new == ["c"]
    assert st.finished == ["a", "b"] and st.num_free == 6
