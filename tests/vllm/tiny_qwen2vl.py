"""Build a tiny, randomly initialised Qwen2-VL checkpoint for CPU vLLM tests.

Why Qwen2-VL besides the tiny PaliGemma (tests/vllm/tiny_model.py): it
declares placeholder metadata (`image_grid_thw`), which is what vLLM's E/PD
proxy needs to send the prefill/decode instance an image as metadata only
(its rewrite mode: `image_embeds` carrying the grid, no pixels). PaliGemma
declares none, so the proxy can only send it the media (`--no-rewrite`).

The result is a Hugging Face style folder that `vllm serve` loads as
`Qwen2VLForConditionalGeneration` (about 2.4 MB):

* **Tokenizer**: one token per printable ASCII character (as the tiny
  PaliGemma's) plus Qwen's special tokens (`<|endoftext|>`, `<|im_start|>`,
  `<|im_end|>`, `<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>`,
  `<|video_pad|>`...), and a chat template in Qwen's form, each image as
  `<|vision_start|><|image_pad|><|vision_end|>`.
* **Image processor**: `Qwen2VLImageProcessor` with `max_pixels` 112 x 112
  (patch 14, merge 2): an image of 112 x 112 or larger is 8 x 8 patches, 16
  embeddings; a 56 x 56 one is 4 embeddings (tests use the two sizes where
  they need outputs of two sizes).
* **Model**: a 2-layer vision tower (embed 64, 2 heads) with the patch
  merger into a 2-layer Qwen2 language model (hidden 128, 4 heads x 32, one
  KV head, M-RoPE sections 4/6/6). Weights drawn as the tiny PaliGemma's
  are, for the same reasons: N(0, 1/fan_in) matrices, an attention output
  gain so that images steer the answer, and an untied LM head whose logits
  have a clear but unsaturated top-1. float32; deterministic per `seed`.

Usage::

    python tests/vllm/tiny_qwen2vl.py OUTDIR [--seed N]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models

from tests.vllm.tiny_model import ATTN_OUT_GAIN, CHARS, LOGIT_STD

HIDDEN = 128
INTERMEDIATE = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 1
HEAD_DIM = HIDDEN // HEADS  # 32
MROPE_SECTION = [4, 6, 6]  # sums to HEAD_DIM / 2
VISION_EMBED = 64
VISION_HEADS = 2
VISION_DEPTH = 2
VISION_MLP_RATIO = 2
PATCH = 14
TEMPORAL_PATCH = 2
MERGE = 2
MAX_SIDE = 112  # max_pixels = MAX_SIDE ** 2
MIN_SIDE = 56  # min_pixels = MIN_SIDE ** 2
MAX_POSITIONS = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                  "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                  "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                  "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def image_embeddings(side: int) -> int:
    """How many embeddings the encoder makes of a `side` x `side` image (side
    a multiple of 28 between MIN_SIDE and MAX_SIDE, or larger: resized down)."""
    side = min(side, MAX_SIDE)
    return (side // PATCH) ** 2 // (MERGE * MERGE)


def _tokenizer() -> tuple[Tokenizer, int]:
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, "<unk>", *CHARS])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=True))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS])
    size = tok.get_vocab_size(with_added_tokens=True)
    return tok, int(math.ceil(size / 64) * 64)


def _config(vocab_size: int, ids: dict[str, int]) -> dict:
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": MROPE_SECTION},
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "torch_dtype": "float32",
        "vision_config": {
            "depth": VISION_DEPTH,
            "embed_dim": VISION_EMBED,
            "hidden_size": HIDDEN,
            "hidden_act": "quick_gelu",
            "mlp_ratio": VISION_MLP_RATIO,
            "num_heads": VISION_HEADS,
            "in_channels": 3,
            "in_chans": 3,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": TEMPORAL_PATCH,
        },
    }


def _weights(vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return normal(out_f, in_f, std=1.0 / math.sqrt(in_f))

    def norm(n: int) -> torch.Tensor:  # LayerNorm and Qwen2's RMSNorm scale by the weight
        return 1.0 + normal(n, std=0.1)

    w: dict[str, torch.Tensor] = {}
    e, patch_in = VISION_EMBED, 3 * TEMPORAL_PATCH * PATCH * PATCH
    w["visual.patch_embed.proj.weight"] = normal(e, 3, TEMPORAL_PATCH, PATCH, PATCH,
                                                 std=1.0 / math.sqrt(patch_in))
    for i in range(VISION_DEPTH):
        p = f"visual.blocks.{i}."
        for ln in ("norm1", "norm2"):
            w[f"{p}{ln}.weight"] = norm(e)
            w[f"{p}{ln}.bias"] = normal(e, std=0.02)
        w[p + "attn.qkv.weight"] = linear(3 * e, e)
        w[p + "attn.qkv.bias"] = normal(3 * e, std=0.02)
        w[p + "attn.proj.weight"] = linear(e, e)
        w[p + "attn.proj.bias"] = normal(e, std=0.02)
        w[p + "mlp.fc1.weight"] = linear(e * VISION_MLP_RATIO, e)
        w[p + "mlp.fc1.bias"] = normal(e * VISION_MLP_RATIO, std=0.02)
        w[p + "mlp.fc2.weight"] = linear(e, e * VISION_MLP_RATIO)
        w[p + "mlp.fc2.bias"] = normal(e, std=0.02)
    merged = e * MERGE * MERGE
    w["visual.merger.ln_q.weight"] = norm(e)
    w["visual.merger.ln_q.bias"] = normal(e, std=0.02)
    w["visual.merger.mlp.0.weight"] = linear(merged, merged)
    w["visual.merger.mlp.0.bias"] = normal(merged, std=0.02)
    w["visual.merger.mlp.2.weight"] = linear(HIDDEN, merged)
    w["visual.merger.mlp.2.bias"] = normal(HIDDEN, std=0.02)

    w["model.embed_tokens.weight"] = normal(vocab_size, HIDDEN, std=1.0)
    q_out, kv_out = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = linear(q_out, HIDDEN)
        w[p + "self_attn.q_proj.bias"] = normal(q_out, std=0.02)
        w[p + "self_attn.k_proj.weight"] = linear(kv_out, HIDDEN)
        w[p + "self_attn.k_proj.bias"] = normal(kv_out, std=0.02)
        w[p + "self_attn.v_proj.weight"] = linear(kv_out, HIDDEN)
        w[p + "self_attn.v_proj.bias"] = normal(kv_out, std=0.02)
        w[p + "self_attn.o_proj.weight"] = linear(HIDDEN, q_out) * ATTN_OUT_GAIN
        w[p + "mlp.gate_proj.weight"] = linear(INTERMEDIATE, HIDDEN)
        w[p + "mlp.up_proj.weight"] = linear(INTERMEDIATE, HIDDEN)
        w[p + "mlp.down_proj.weight"] = linear(HIDDEN, INTERMEDIATE)
        w[p + "input_layernorm.weight"] = norm(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = norm(HIDDEN)
    w["model.norm.weight"] = norm(HIDDEN)
    w["lm_head.weight"] = normal(vocab_size, HIDDEN, std=LOGIT_STD / math.sqrt(HIDDEN))
    return {k: t.contiguous() for k, t in w.items()}


def build_tiny_qwen2vl(folder: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Write a tiny random Qwen2-VL (config, tokenizer, processor, weights)."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok, vocab_size = _tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tok.save(str(folder / "tokenizer.json"))

    def dump(name: str, obj: dict) -> None:
        (folder / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")

    dump("config.json", _config(vocab_size, ids))
    dump("tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
        "processor_class": "Qwen2VLProcessor",
    })
    pixels = {"min_pixels": MIN_SIDE * MIN_SIDE, "max_pixels": MAX_SIDE * MAX_SIDE}
    processor = {
        **pixels,
        "size": {"shortest_edge": pixels["min_pixels"], "longest_edge": pixels["max_pixels"]},
        "patch_size": PATCH,
        "temporal_patch_size": TEMPORAL_PATCH,
        "merge_size": MERGE,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_resize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "processor_class": "Qwen2VLProcessor",
    }
    dump("preprocessor_config.json", {**processor, "image_processor_type": "Qwen2VLImageProcessor"})
    dump("video_preprocessor_config.json",
         {**processor, "video_processor_type": "Qwen2VLVideoProcessor"})
    dump("chat_template.json", {"chat_template": CHAT_TEMPLATE})
    dump("generation_config.json", {"bos_token_id": ids["<|endoftext|>"],
                                    "eos_token_id": ids["<|im_end|>"],
                                    "pad_token_id": ids["<|endoftext|>"]})
    save_file(_weights(vocab_size, seed), str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=pathlib.Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = build_tiny_qwen2vl(args.outdir, seed=args.seed)
    for f in sorted(out.iterdir()):
        print(f"{f}  {f.stat().st_size} bytes")


if __name__ == "__main__":
    main()
