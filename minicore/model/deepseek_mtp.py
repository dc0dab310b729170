"""DeepSeek's multi-token-prediction (MTP) layers, the model method "mtp" drafts with: the
num_nextn_predict_layers layers a DeepSeek-V3 checkpoint ships after its num_hidden_layers decoder
layers (model.layers.{num_hidden_layers + i}.*), which transformers drops on load.

Mirrors vllm/model_executor/models/deepseek_mtp.py (DeepSeekMTP, DeepSeekMultiTokenPredictorLayer,
SharedHead): MTP layer i takes the embedding of the next token (zeroed at position 0, as vLLM) and
the target's hidden state at a position, normalises them (enorm, hnorm), projects their
concatenation (eh_proj) and runs one full decoder layer (mtp_block), an instance of the model's
own transformers class with layer_idx num_hidden_layers + i: its latent attention
(minicore/model/mla.py) reads and writes a paged KV cache of its own, its MoE is DeepSeek's.
shared_head's norm gives the hidden state that shared_head's head turns into the draft's logits
and that the next draft step takes (vLLM's recycle of the post-norm hidden). The embedding and
the rotary embedding are the target's (vLLM shares embed_tokens too). Expert parallelism leaves
these layers whole on every rank (vLLM shards their experts as the model's): an MTP forward then
needs no collective, so each rank runs it on its own and a DP dummy batch never does. Left out:
several MTP layers (vLLM's multi-module MTP: refused), quantized weights, DeepSeek-V3.2's indexer,
other families' MTP layers (Qwen3-Next, GLM, MiMo).
"""

from pathlib import Path

import torch
from torch import nn

from minicore.model.attention import META_KWARG, AttentionMetadata
from minicore.model.expert_checkpoint import stack_experts

MTP_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
# An MTP layer's own weights (vLLM's spec_layer_weight_names); the rest are its mtp_block's.
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


def num_mtp_layers(config) -> int:
    """The checkpoint's MTP layers, or ValueError naming why the model cannot draft with them."""
    model_type = getattr(config, "model_type", "?")
    if model_type not in MTP_MODEL_TYPES:
        architecture = (getattr(config, "architectures", None) or ["?"])[0]
        raise ValueError(f"speculative_config: method 'mtp' drafts with the multi-token-"
                         f"prediction layers of DeepSeek-V2/V3; model {model_type!r} "
                         f"({architecture}) has none")
    if (n := getattr(config, "num_nextn_predict_layers", None) or 0) < 1:
        raise ValueError(f"speculative_config: method 'mtp' needs the model's MTP layers, and "
                         f"this {model_type} has none (num_nextn_predict_layers is {n})")
    if n > 1:
        raise ValueError(f"speculative_config: minicore drafts with one MTP layer (DeepSeek-V3 "
                         f"ships one, which every draft step reuses); this {model_type} has {n}")
    return n


class SharedHead(nn.Module):
    def __init__(self, norm: nn.Module, head: nn.Linear):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden_states)


class DeepSeekMultiTokenPredictorLayer(nn.Module):
    def __init__(self, model: nn.Module, layer_idx: int):
        config, base = model.config, model.base_model
        super().__init__()
        size, norm = config.hidden_size, type(base.norm)
        self.enorm = norm(size, eps=config.rms_norm_eps)
        self.hnorm = norm(size, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * size, size, bias=False)
        self.shared_head = SharedHead(norm(size, eps=config.rms_norm_eps),
                                      nn.Linear(size, config.vocab_size, bias=False))
        self.mtp_block = type(base.layers[0])(config, layer_idx)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                previous_hidden_states: torch.Tensor, position_embeddings,
                meta: AttentionMetadata) -> torch.Tensor:
        """[T, hidden] each in, shared_head's normalised hidden states [T, hidden] out."""
        inputs_embeds = inputs_embeds.masked_fill((positions == 0)[:, None], 0)
        hidden = self.eh_proj(torch.cat([self.enorm(inputs_embeds),
                                         self.hnorm(previous_hidden_states)], dim=-1))
        hidden = self.mtp_block(hidden[None], position_ids=positions[None],
                                position_embeddings=position_embeddings, **{META_KWARG: meta})
        return self.shared_head(hidden[0])


class DeepSeekMTP(nn.Module):
    """The MTP layers of a loaded DeepSeek model, their weights read from its checkpoint."""

    def __init__(self, model: nn.Module, model_dir: Path, num_layers: int):
        super().__init__()
        self.mtp_start_layer_idx = start = model.config.num_hidden_layers
        with torch.device("meta"):
            self.layers = nn.ModuleList(DeepSeekMultiTokenPredictorLayer(model, start + i)
                                        for i in range(num_layers))
        load_mtp_weights(self, model, model_dir)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                previous_hidden_states: torch.Tensor, position_embeddings,
                meta: AttentionMetadata, spec_step_idx: int = 0) -> torch.Tensor:
        layer = self.layers[spec_step_idx % len(self.layers)]
        return layer(inputs_embeds, positions, previous_hidden_states, position_embeddings, meta)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        return self.layers[spec_step_idx % len(self.layers)].shared_head.head(hidden_states)


def load_mtp_weights(mtp: DeepSeekMTP, model: nn.Module, model_dir: Path) -> None:
    """Each MTP layer's tensors from the checkpoint's safetensors, in place of the meta ones, on
    the model's device, each in the dtype the model keeps the same tensor of its last layer in
    (transformers keeps DeepSeek's router in float32), else the model's. ValueError naming what
    is missing."""
    from safetensors import safe_open

    reference = {name: t.dtype for name, t in model.base_model.layers[-1].state_dict().items()}
    handles = [safe_open(f, framework="pt") for f in sorted(model_dir.glob("*.safetensors"))]
    device = next(model.parameters()).device
    for i, layer in enumerate(mtp.layers):
        prefix = f"model.layers.{mtp.mtp_start_layer_idx + i}."
        found = {name[len(prefix):]: h.get_tensor(name) for h in handles for name in h.keys()
                 if name.startswith(prefix)}
        if not found:
            raise ValueError(f"speculative_config: method 'mtp' needs the model's MTP layers, "
                             f"and the checkpoint at {model_dir} has no weights of layer "
                             f"{mtp.mtp_start_layer_idx + i} ({prefix}*)")
        try:
            stacked = stack_experts(found, model.config.n_routed_experts)
        except ValueError as e:
            raise ValueError(f"speculative_config: the MTP layer {prefix}* of {model_dir}: "
                             f"{e}") from None
        state = {}
        for name, tensor in stacked.items():
            if name == "embed_tokens.weight":
                continue  # the target's embedding (vLLM's shared_weight_names)
            name = name if name.startswith(_OWN) else "mtp_block." + name
            dtype = reference.get(name.removeprefix("mtp_block."), model.dtype)
            state[name] = tensor.to(device=device, dtype=dtype)
        missing, unexpected = layer.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"speculative_config: the MTP layer {prefix}* of {model_dir} does "
                             f"not fit {type(layer.mtp_block).__name__}: missing {missing}, "
                             f"unexpected {unexpected}")
