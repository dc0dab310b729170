"""EagleProposer: the runner's MTP drafts, proposed right after it samples, from the step's hidden
states through the checkpoint's MTP layers (minicore/model/deepseek_mtp.py).

Mirrors vllm/v1/spec_decode/eagle.py (EagleProposer, on llm_base_proposer.py's
SpecDecodeBaseProposer) with its padded drafter batch (vLLM's default), for method "mtp":
- the first pass runs the MTP layer over every token of the step, with the step's own attention
  metadata: at each position the token after it and the target's hidden state there, the input
  ids shifted by one (each request's state already holds what it accepted and its new token);
  this writes the MTP layer's KV of every computed position, mid-prefill chunks included.
  Positions past a request's last accepted one (its rejected drafts) get token 0: their KV is
  written again by the next step, which computes those positions, before anything reads it;
- each request that sampled takes draft 0 as the argmax at its last accepted position, then k - 1
  single-token steps, each on the draft before, one position further, and the MTP's own hidden
  state (the draft steps' KV, in the lookahead slots the scheduler allocated, is rewritten the
  same way), none past max_model_len - 1.
Drafts are greedy (vLLM's default: the rejection sampler takes them as certain). With sync
scheduling the runner keeps them for the engine's MTPDrafter (minicore/spec_decode/mtp.py, vLLM's
take_draft_token_ids); with async scheduling AsyncSpecDecodeSampler (async_spec_decode.py) runs
them in the next step. disable_by_batch_size skips the draft steps, never the first pass, which
keeps the MTP layer's KV whole (as vLLM does with K=0). Left out: EAGLE / EAGLE-3 heads, draft
models, tree drafts, probabilistic draft sampling, CUDA graphs.
"""

import torch

from minicore.model.attention import AttentionMetadata
from minicore.model.deepseek_mtp import DeepSeekMTP, num_mtp_layers
from minicore.model.loader import resolve_model_dir
from minicore.model.runner_base import CachedRequestState
from minicore.scheduler.output import ModelRunnerOutput


class EagleProposer:
    def __init__(self, runner):
        """runner: the ModelRunner being built (its model, config and layer binding)."""
        config, model = runner.config, runner.model
        spec = config.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.disable_by_batch_size = spec.disable_by_batch_size
        self.max_model_len = config.scheduler_config.max_model_len
        num_layers = num_mtp_layers(model.config)
        if config.model_config.model is None:
            raise ValueError("speculative_config: method 'mtp' reads the MTP layers from the "
                             "model's directory: give the model by its path")
        self.model = DeepSeekMTP(model, resolve_model_dir(config.model_config.model), num_layers)
        runner.bind_layers(self.model)
        # The KV caches the runner allocates past the model's own: one an MTP layer.
        self.num_layers = num_layers
        self.embed_tokens = model.get_input_embeddings()
        self.rotary_emb = model.base_model.rotary_emb
        self.device = runner.device
        self._draft_token_ids: dict[str, list[int]] = {}

    def propose_draft_token_ids(self, hidden: torch.Tensor, meta: AttentionMetadata,
                                states: list[CachedRequestState],
                                output: ModelRunnerOutput) -> None:
        """Sync scheduling: the step's drafts, kept for take_draft_token_ids."""
        limit = self.disable_by_batch_size
        self._draft_token_ids = self.propose(hidden, meta, states, output,
                                             not limit or len(states) < limit)

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        drafts, self._draft_token_ids = self._draft_token_ids, {}
        return drafts

    def forget(self, req_ids: set[str]) -> None:
        """Nothing is kept per request: a request's MTP KV lives in its blocks."""

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, meta: AttentionMetadata,
                states: list[CachedRequestState], output: ModelRunnerOutput,
                drafting: bool) -> dict[str, list[int]]:
        """The first pass over the step's tokens (hidden: the target's [T, hidden], meta: the
        step's metadata); per request that sampled, its drafts (none unless drafting)."""
        input_ids, rows, last = self._first_pass_inputs(meta, states, output)
        mtp_hidden = self._forward(input_ids, meta.positions, hidden, meta, 0)
        req_ids = [output.req_ids[row] for row in rows]
        drafts: dict[str, list[int]] = {req_id: [] for req_id in req_ids}
        # Per request, the drafts max_model_len leaves room for (SpecDecode cuts them there).
        room = [min(self.num_speculative_tokens,
                    self.max_model_len - 1 - len(states[row].token_ids)) for row in rows]
        active = [j for j, r in enumerate(room) if r > 0] if drafting else []
        if not active:
            return drafts
        index = torch.tensor([last[j] for j in active], device=self.device)
        positions, mtp_hidden = meta.positions[index], mtp_hidden[index]
        token = self.model.compute_logits(mtp_hidden).argmax(dim=-1)
        for step in range(1, self.num_speculative_tokens + 1):
            for j, draft in zip(active, token.tolist()):
                drafts[req_ids[j]].append(draft)
            if not (keep := [i for i, j in enumerate(active) if room[j] > step]):
                break
            if len(keep) < len(active):
                pick = torch.tensor(keep, device=self.device)
                token, positions, mtp_hidden = token[pick], positions[pick], mtp_hidden[pick]
                active = [active[i] for i in keep]
            # The draft before, one position further, on the MTP's own hidden state there.
            positions = positions + 1
            step_meta = AttentionMetadata.build([states[rows[j]].block_ids for j in active],
                                                positions.tolist(), [1] * len(active),
                                                meta.kv_caches)
            mtp_hidden = self._forward(token, positions, mtp_hidden, step_meta, step)
            token = self.model.compute_logits(mtp_hidden, step).argmax(dim=-1)
        return drafts

    def _first_pass_inputs(self, meta: AttentionMetadata, states: list[CachedRequestState],
                           output: ModelRunnerOutput
                           ) -> tuple[torch.Tensor, list[int], list[int]]:
        """The step's input ids shifted by one, token 0 past a request's known tokens; the rows
        that sampled, and the token index of each one's last accepted position."""
        qsl = meta.query_start_loc_cpu
        ids, rows, last = [], [], []
        for row, state in enumerate(states):
            start, n = state.num_computed_tokens, qsl[row + 1] - qsl[row]
            shifted = state.token_ids[start + 1:start + n + 1]
            ids += shifted + [0] * (n - len(shifted))
            if output.sampled_token_ids[row]:
                rows.append(row)
                # The state ends with the accepted drafts and one new token.
                last.append(qsl[row] + len(state.token_ids) - 2 - start)
        return torch.tensor(ids, device=self.device), rows, last

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 previous_hidden_states: torch.Tensor, meta: AttentionMetadata,
                 spec_step_idx: int) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        position_embeddings = self.rotary_emb(embeds[None], positions[None])
        return self.model(embeds, positions, previous_hidden_states, position_embeddings, meta,
                          spec_step_idx)
