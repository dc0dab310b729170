"""MTPDrafter: drafts from the checkpoint's multi-token-prediction layers (method "mtp", vLLM's
older "deepseek_mtp"), the engine's side of them.

The drafts need the target's hidden states, so the model runner proposes them right after it
samples (minicore/model/eagle.py, vLLM's EagleProposer) and keeps them; after the scheduler's
update this drafter takes them (vLLM's EngineCore.post_step: take_draft_token_ids) and gives them
to the scheduler through the shared selection (requests now decoding, none at
disable_by_batch_size). With async scheduling the runner verifies its own proposals and this
drafter is not built. use_eagle: a step allocates num_lookahead_tokens KV slots past its tokens
(the draft steps write the MTP layer's KV there) and a prefix-cache hit leaves its last block to
be computed again (vLLM's drop_eagle_block), as vLLM does for EAGLE and MTP. Pure Python; the
model's checks (DeepSeek-V2/V3 with num_nextn_predict_layers and their weights) are the runner's.
"""

from minicore.request import Request
from minicore.spec_decode.config import SpeculativeConfig
from minicore.spec_decode.drafter import Drafter, DraftRequest


class MTPDrafter(Drafter):
    method = "mtp"
    use_eagle = True

    @classmethod
    def verify_config(cls, config: SpeculativeConfig) -> None:
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(config, name) is not None:
                raise ValueError(f"speculative_config: {name} is the ngram method's; method "
                                 "'mtp' drafts with the model's MTP layers")

    def __init__(self, config: SpeculativeConfig, max_model_len: int, model_runner):
        super().__init__(config, max_model_len)
        # The transformers runner (EngineConfig refuses drafts with any other).
        self.model_runner = model_runner
        self._proposed: dict[str, list[int]] = {}

    def propose(self, requests, num_running, scheduler_output):
        self._proposed = self.model_runner.take_draft_token_ids()
        return super().propose(requests, num_running, scheduler_output)

    def propose_for(self, request: Request | DraftRequest) -> list[int]:
        return self._proposed.get(request.request_id, [])
