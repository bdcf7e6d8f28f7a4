"""Build a tiny, randomly initialised PaliGemma checkpoint for CPU vLLM tests.

Nothing can be fetched from a model hub in CI, so the end-to-end test builds
its own multimodal model: a SigLIP vision tower + linear projector + Gemma
language model, i.e. exactly the layout that vLLM's
``PaliGemmaForConditionalGeneration`` loads.  The result is a normal Hugging
Face style folder (config.json, tokenizer, preprocessor config,
model.safetensors) that ``vllm.LLM(model=folder)`` accepts.

Choices and why:

* **2 layers, hidden 128** (both towers): the smallest shapes that still
  exercise every code path (attention, MLP, residual stream, the multimodal
  merge) while keeping the checkpoint around 3.5 MB and engine start-up
  dominated by vLLM itself rather than by weights.  4 query heads x head_dim
  32 (the smallest head size vLLM's CPU attention backend supports), 1 KV
  head (PaliGemma uses multi-query attention).
* **56x56 images, patch 14** -> (56/14)^2 = 16 image tokens per image, so a
  prompt is ~16 placeholder tokens + a few text tokens: prefill is cheap and
  the encoder output per image is a small 16x128 tensor.
* **Weight scale**: every matrix is drawn from N(0, 1/fan_in), which keeps
  activations at unit scale through both towers; embeddings use
  N(0, 1/hidden) because Gemma multiplies text embeddings by sqrt(hidden).
  Image features (post-LayerNorm SigLIP output through the projector) thus
  have the same magnitude as text embeddings.  The Gemma attention output
  projection is drawn twice as large (ATTN_OUT_GAIN): attention averages
  over all ~28 prompt positions, which shrinks its output, and at gain 1 the
  last token's own embedding dominates the residual stream so every image
  gets the same first token; at gain 2 the first generated token already
  differs for most images (5-6 of 6 random images, checked for seeds 0-3).
  vLLM's ``load_format="dummy"`` is *not* usable: it fills weights with
  U(-1e-3, 1e-3), which makes the output independent of the image.
  The LM head is *not* tied to the embedding: with tied random weights the
  logit of the last input token dominates (its embedding is still in the
  residual stream), so the model just echoes the prompt's final "\\n" for
  every image.  A separate LM head drawn from N(0, (LOGIT_STD^2)/hidden)
  gives logits of standard deviation ~LOGIT_STD, so greedy decoding is
  stable (clear top-1) but not saturated (logprobs visibly below 0).
* **Tokenizer** built offline with the ``tokenizers`` library: one token per
  printable ASCII character plus the Gemma specials (``<pad>`` 0, ``<eos>`` 1,
  ``<bos>`` 2, ``<unk>`` 3) and the PaliGemma extras ``<image>``,
  ``<loc0000>``..``<loc1023>``, ``<seg000>``..``<seg127>`` (PaliGemma's HF
  processor adds the latter if missing, which would make the tokenizer
  disagree with the model's vocab size).  ``add_bos_token`` is false
  (PaliGemma 2 convention): vLLM then builds
  ``<image>*16 <bos> prompt \\n`` itself.
* Weights are stored in vLLM's native (pre transformers-4.52) names, e.g.
  ``vision_tower.vision_model.*``, ``multi_modal_projector.linear.*``,
  ``language_model.model.*``; vLLM's loader takes them as they are.
* float32 throughout; deterministic for a given ``seed`` (a private
  ``torch.Generator`` is used, global RNG state is untouched).
* Checked: vLLM 0.32 (CPU) greedy tokens and logprobs for this model equal
  those of transformers' ``PaliGemmaForConditionalGeneration`` with eager
  attention and a plain causal mask (vLLM's CPU attention backend does not
  apply PaliGemma's bidirectional image prefix).

Usage::

    python tests/vllm/tiny_model.py OUTDIR [--seed N]

Only torch, safetensors and tokenizers are needed (transformers is not
imported here; vLLM brings it).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import string
from dataclasses import dataclass

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models

# --- shapes -----------------------------------------------------------------
HIDDEN = 128
INTERMEDIATE = 256
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 1
HEAD_DIM = HIDDEN // NUM_HEADS  # 32
IMAGE_SIZE = 56
PATCH_SIZE = 14
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 16
MAX_POSITIONS = 512


@dataclass(frozen=True)
class VisionShape:
    """The SigLIP tower's shape: the default is the tests' tiny one; a
    benchmark uses SIGLIP_BASE, so encoding costs what it costs beside the LM."""

    hidden: int = HIDDEN
    intermediate: int = INTERMEDIATE
    layers: int = NUM_LAYERS
    heads: int = NUM_HEADS
    image_size: int = IMAGE_SIZE
    patch_size: int = PATCH_SIZE

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2


TINY = VisionShape()
SIGLIP_BASE = VisionShape(hidden=768, intermediate=3072, layers=12, heads=12, image_size=224,
                          patch_size=16)  # 196 image tokens

# --- tokenizer --------------------------------------------------------------
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # Gemma ids 0..3
CHARS = [c for c in string.printable if c not in "\r\x0b\x0c"]  # incl. " ", "\n", "\t"
IMAGE_TOKEN = "<image>"
EXTRA_TOKENS = [f"<loc{i:04d}>" for i in range(1024)] + [f"<seg{i:03d}>" for i in range(128)]
LOGIT_STD = 4.0  # spread of the untied LM head's logits
ATTN_OUT_GAIN = 2.0  # Gemma o_proj scale, lets image features steer the output


def _build_tokenizer() -> tuple[Tokenizer, int]:
    """Character-level BPE (no merges): every printable ASCII char is a token."""
    base = SPECIAL_TOKENS + CHARS
    vocab = {tok: i for i, tok in enumerate(base)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=True))
    tok.decoder = decoders.Fuse()  # concatenate, no spaces between chars
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in [*SPECIAL_TOKENS, IMAGE_TOKEN]]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in EXTRA_TOKENS])
    size = tok.get_vocab_size(with_added_tokens=True)
    # Round the model's vocabulary up to a multiple of 64 (unused rows are fine).
    return tok, int(math.ceil(size / 64) * 64)


def _config(vocab_size: int, ids: dict[str, int], shape: VisionShape = TINY) -> dict:
    text = {
        "model_type": "gemma",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "pad_token_id": ids["<pad>"],
        "eos_token_id": ids["<eos>"],
        "bos_token_id": ids["<bos>"],
        "torch_dtype": "float32",
    }
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_channels": 3,
        "image_size": shape.image_size,
        "patch_size": shape.patch_size,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
        "projection_dim": HIDDEN,
        "num_image_tokens": shape.image_tokens,
        "vision_use_head": False,
        "torch_dtype": "float32",
    }
    return {
        "architectures": ["PaliGemmaForConditionalGeneration"],
        "model_type": "paligemma",
        "hidden_size": HIDDEN,
        "projection_dim": HIDDEN,
        "vocab_size": vocab_size,
        "image_token_index": ids[IMAGE_TOKEN],
        "pad_token_id": ids["<pad>"],
        "eos_token_id": ids["<eos>"],
        "bos_token_id": ids["<bos>"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "text_config": text,
        "vision_config": vision,
    }


def _weights(vocab_size: int, seed: int, shape: VisionShape = TINY) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return normal(out_f, in_f, std=1.0 / math.sqrt(in_f))

    def bias(n: int) -> torch.Tensor:
        return normal(n, std=0.02)

    w: dict[str, torch.Tensor] = {}

    # SigLIP vision tower (vLLM name prefix: vision_tower.vision_model.)
    v = "vision_tower.vision_model."
    vh, vi, patch = shape.hidden, shape.intermediate, shape.patch_size
    fan_in_patch = 3 * patch * patch
    w[v + "embeddings.patch_embedding.weight"] = normal(
        vh, 3, patch, patch, std=1.0 / math.sqrt(fan_in_patch)
    )
    w[v + "embeddings.patch_embedding.bias"] = bias(vh)
    w[v + "embeddings.position_embedding.weight"] = normal(shape.image_tokens, vh, std=0.5)
    for i in range(shape.layers):
        p = f"{v}encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            w[f"{p}self_attn.{proj}.weight"] = linear(vh, vh)
            w[f"{p}self_attn.{proj}.bias"] = bias(vh)
        for ln in ("layer_norm1", "layer_norm2"):
            w[f"{p}{ln}.weight"] = 1.0 + normal(vh, std=0.1)
            w[f"{p}{ln}.bias"] = bias(vh)
        w[p + "mlp.fc1.weight"] = linear(vi, vh)
        w[p + "mlp.fc1.bias"] = bias(vi)
        w[p + "mlp.fc2.weight"] = linear(vh, vi)
        w[p + "mlp.fc2.bias"] = bias(vh)
    w[v + "post_layernorm.weight"] = 1.0 + normal(vh, std=0.1)
    w[v + "post_layernorm.bias"] = bias(vh)

    # Projector: vision hidden -> text hidden
    w["multi_modal_projector.linear.weight"] = linear(HIDDEN, vh)
    w["multi_modal_projector.linear.bias"] = bias(HIDDEN)

    # Gemma language model (vLLM name prefix: language_model.model.)
    t = "language_model.model."
    w[t + "embed_tokens.weight"] = normal(vocab_size, HIDDEN, std=1.0 / math.sqrt(HIDDEN))
    q_out, kv_out = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    for i in range(NUM_LAYERS):
        p = f"{t}layers.{i}."
        w[p + "self_attn.q_proj.weight"] = linear(q_out, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = linear(kv_out, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = linear(kv_out, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = linear(HIDDEN, q_out) * ATTN_OUT_GAIN
        w[p + "mlp.gate_proj.weight"] = linear(INTERMEDIATE, HIDDEN)
        w[p + "mlp.up_proj.weight"] = linear(INTERMEDIATE, HIDDEN)
        w[p + "mlp.down_proj.weight"] = linear(HIDDEN, INTERMEDIATE)
        w[p + "input_layernorm.weight"] = normal(HIDDEN, std=0.1)  # gain = 1 + w
        w[p + "post_attention_layernorm.weight"] = normal(HIDDEN, std=0.1)
    w[t + "norm.weight"] = normal(HIDDEN, std=0.1)
    w["language_model.lm_head.weight"] = normal(
        vocab_size, HIDDEN, std=LOGIT_STD / math.sqrt(HIDDEN)
    )
    return {k: t_.contiguous() for k, t_ in w.items()}


def build_tiny_paligemma(folder: pathlib.Path, seed: int = 0,
                         shape: VisionShape = TINY) -> pathlib.Path:
    """Write a tiny random PaliGemma (config, tokenizer, processor, weights),
    its vision tower of `shape`."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)

    tok, vocab_size = _build_tokenizer()
    ids = {t: tok.token_to_id(t) for t in [*SPECIAL_TOKENS, IMAGE_TOKEN]}
    tok.save(str(folder / "tokenizer.json"))

    def dump(name: str, obj: dict) -> None:
        (folder / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")

    dump("config.json", _config(vocab_size, ids, shape))
    dump(
        "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "add_bos_token": False,
            "add_eos_token": False,
            "model_max_length": MAX_POSITIONS,
            "padding_side": "left",
            "processor_class": "PaliGemmaProcessor",
        },
    )
    dump(
        "special_tokens_map.json",
        {
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "additional_special_tokens": [IMAGE_TOKEN],
        },
    )
    dump(
        "preprocessor_config.json",
        {
            "image_processor_type": "SiglipImageProcessor",
            "processor_class": "PaliGemmaProcessor",
            "image_seq_length": shape.image_tokens,
            "size": {"height": shape.image_size, "width": shape.image_size},
            "do_resize": True,
            "resample": 3,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_convert_rgb": True,
        },
    )
    dump(
        "generation_config.json",
        {"bos_token_id": ids["<bos>"], "eos_token_id": ids["<eos>"], "pad_token_id": ids["<pad>"]},
    )
    save_file(
        _weights(vocab_size, seed, shape), str(folder / "model.safetensors"),
        metadata={"format": "pt"}
    )
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=pathlib.Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = build_tiny_paligemma(args.outdir, seed=args.seed)
    for f in sorted(out.iterdir()):
        print(f"{f}  {f.stat().st_size} bytes")


if __name__ == "__main__":
    main()
