"""Random MTP (multi-token-prediction) layers for a tiny DeepSeek checkpoint, and the drafts they
propose computed by hand over a whole sequence (no KV cache), with plain torch and transformers'
own decoder layer.

add_mtp_layers appends the layers to a saved model's safetensors under the names DeepSeek-V3 ships
them (model.layers.{num_hidden_layers + i}.*, its experts one tensor each, the embedding copied)
and sets num_nextn_predict_layers in its config.json. mtp_layers builds the same layers from the
same seed, so that reference_drafts can run them on transformers' attention (SDPA, causal) while
minicore runs what it loaded from the checkpoint."""

import importlib
import json
from pathlib import Path

import torch
from torch import nn


def mtp_layers(config, num_layers: int = 1, seed: int = 1) -> nn.ModuleList:
    """Per MTP layer a module with enorm, hnorm, eh_proj, shared_head.{norm, head} and
    mtp_block (the model's decoder layer class at index num_hidden_layers + i, on SDPA), in
    float32; weights normal with the config's initializer_range, norms ones, the router's bias
    zero."""
    config = config.__class__.from_dict(config.to_dict())
    config._attn_implementation = "sdpa"
    modeling = importlib.import_module(
        f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    prefix = type(config).__name__.removesuffix("Config")
    decoder = getattr(modeling, prefix + "DecoderLayer")
    norm = getattr(modeling, prefix + "RMSNorm")
    size, eps = config.hidden_size, config.rms_norm_eps
    torch.manual_seed(seed)
    layers = nn.ModuleList()
    for i in range(num_layers):
        layer = nn.Module()
        layer.enorm, layer.hnorm = norm(size, eps), norm(size, eps)
        layer.eh_proj = nn.Linear(2 * size, size, bias=False)
        layer.shared_head = nn.Module()
        layer.shared_head.norm = norm(size, eps)
        layer.shared_head.head = nn.Linear(size, config.vocab_size, bias=False)
        layer.mtp_block = decoder(config, config.num_hidden_layers + i)
        layers.append(layer)
    with torch.no_grad():
        for name, tensor in [*layers.named_parameters(), *layers.named_buffers()]:
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                tensor.zero_()
            else:
                tensor.normal_(0.0, config.initializer_range)
    return layers.float().eval()


def add_mtp_layers(path: Path, num_layers: int = 1, seed: int = 1) -> Path:
    """mtp_layers(its config) appended to the model saved at path, as a DeepSeek checkpoint
    holds them; returns path."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    file = Path(path) / "model.safetensors"
    tensors = load_file(file)
    for i, layer in enumerate(mtp_layers(config, num_layers, seed)):
        prefix = f"model.layers.{config.num_hidden_layers + i}."
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        for name, tensor in layer.state_dict().items():
            name = name.removeprefix("mtp_block.")
            if name == "mlp.experts.gate_up_proj":
                for j, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1))):
                    tensors[f"{prefix}mlp.experts.{j}.gate_proj.weight"] = gate.contiguous()
                    tensors[f"{prefix}mlp.experts.{j}.up_proj.weight"] = up.contiguous()
            elif name == "mlp.experts.down_proj":
                for j, down in enumerate(tensor):
                    tensors[f"{prefix}mlp.experts.{j}.down_proj.weight"] = down.contiguous()
            else:
                tensors[prefix + name] = tensor.contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    config_file = Path(path) / "config.json"
    fields = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**fields, "num_nextn_predict_layers": num_layers},
                                      indent=2))
    return path


@torch.inference_mode()
def reference_drafts(model, layer: nn.Module, tokens: list[int],
                     k: int) -> tuple[list[int], torch.Tensor]:
    """The k drafts after tokens (whose last one was just sampled) by hand, every position
    recomputed, and draft 0's logits: the target's hidden states over tokens[:-1]; at each
    position p the MTP layer on the embedding of token p + 1 (zero at position 0, as vLLM) and
    the hidden state at p; draft 0 is the argmax at the last position, each next one the argmax
    one position further, on the draft before and the MTP layer's own output there."""
    device = model.device
    hidden = model.model(torch.tensor([tokens[:-1]], device=device)).last_hidden_state[0]
    inputs, drafts, logits = list(tokens[1:]), [], []
    for _ in range(k):
        positions = torch.arange(len(inputs), device=device)
        embeds = model.get_input_embeddings()(torch.tensor(inputs, device=device))
        embeds[0] = 0
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden)], dim=-1))[None]
        position_embeddings = model.model.rotary_emb(x, positions[None])
        out = layer.mtp_block(x, position_ids=positions[None],
                              position_embeddings=position_embeddings)
        out = layer.shared_head.norm(out[0])
        logits.append(layer.shared_head.head(out[-1]))
        drafts.append(int(logits[-1].argmax()))
        inputs.append(drafts[-1])
        hidden = torch.cat([hidden, out[-1:]])
    return drafts, logits[0]
