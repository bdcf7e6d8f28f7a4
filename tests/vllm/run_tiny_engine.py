"""Run a real vLLM engine on CPU with the tiny PaliGemma from tiny_model.py.

Usage::

    tests/vllm/torchvision_shim.sh /tmp/tiny-vllm/tv
    .venv-vllm/bin/python tests/vllm/tiny_model.py /tmp/tiny-vllm/model
    PYTHONPATH=/tmp/tiny-vllm/tv .venv-vllm/bin/python \\
        tests/vllm/run_tiny_engine.py /tmp/tiny-vllm/model

What it does: starts ``vllm.LLM`` (eager, prefix caching off, one image per
prompt), generates greedily (temperature 0, 8 tokens, logprobs=1) for three
56x56 random images with fixed seeds, prints token ids / strings / logprobs
per image and checks that the outputs differ between images.  It then
repeats image 0 and checks the output is identical (determinism).

Encoder forward calls are counted inside the worker process: a function is
shipped with ``LLM.collective_rpc`` (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1
because callables travel cloudpickled) that wraps the model's
``vision_tower.forward`` with a counter stored on the worker object; a second
RPC reads the counter.  vLLM's own encoder cache (per engine, keyed by the
image hash) may serve a repeated image without a new encoder call, which is
reported too.

Alternative counter without VLLM_ALLOW_INSECURE_SERIALIZATION (verified): a
``vllm.general_plugins`` entry point, which vLLM loads in every process
(including the worker) before the model is built.  It can live in a temp
folder on PYTHONPATH: ``probe.py`` with ``register()`` that wraps
``vllm.model_executor.models.siglip.SiglipVisionModel.forward`` at class level
and appends ``"<pid> <num_images>"`` to a file named by an env var, plus
``probe-0.1.dist-info/METADATA`` (``Metadata-Version: 2.1 / Name: probe /
Version: 0.1``) and ``probe-0.1.dist-info/entry_points.txt``
(``[vllm.general_plugins]`` / ``probe = probe:register``).

Flags/env set here (``setdefault``, so callers can override):
VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV cache; default 4), TORCHDYNAMO_DISABLE=1
(with logprobs the sampler torch.compile's ``gather_logprobs`` on the first
request, ~3 s; eager is fine here), VLLM_ALLOW_INSECURE_SERIALIZATION=1.
``--in-process`` sets VLLM_ENABLE_V1_MULTIPROCESSING=0 and OMP_NUM_THREADS=1:
engine core and worker then run inside this process (start ~5 s instead of
~20-50 s, same tokens), but that is not how a real deployment is laid out.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

# --- environment: must be set before vllm is imported / processes spawn -----
# KV cache size in GiB for the CPU backend (default would be 4 GiB).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Allow cloudpickled callables in collective_rpc (encoder-call counter).
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
# Avoid a one-off ~3 s torch.compile of the sampler's logprob gather.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import numpy as np
from PIL import Image

PROMPT = "caption en"  # vLLM inserts <image>*16 <bos> before it and "\n" after
IMAGE_SEEDS = (0, 1, 2)
IMAGE_SIZE = 56


def make_image(seed: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8))


# --- functions executed in the worker process (via collective_rpc) ----------
def _install_encoder_counter(worker) -> str:
    """Wrap vision_tower.forward of the worker's model with a call counter."""
    model = worker.model_runner.model
    tower = model.vision_tower
    if getattr(worker, "_enc_counter", None) is not None:
        return "already installed"
    counter = {"calls": 0, "images": 0}
    orig_forward = tower.forward

    def counting_forward(pixel_values, *args, **kwargs):
        counter["calls"] += 1
        counter["images"] += int(pixel_values.shape[0])
        return orig_forward(pixel_values, *args, **kwargs)

    tower.forward = counting_forward  # instance attribute shadows the method
    worker._enc_counter = counter
    return f"installed on {type(model).__name__}.vision_tower (pid {os.getpid()})"


def _read_encoder_counter(worker) -> dict:
    return dict(worker._enc_counter)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=pathlib.Path)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--no-count", action="store_true", help="skip the encoder counter")
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="run engine core + worker in this process (faster start)",
    )
    args = ap.parse_args()
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # else ~1 s per request

    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=str(args.model),
        dtype=args.dtype,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=args.max_model_len,
        max_num_seqs=4,
        limit_mm_per_prompt={"image": 1},
        seed=0,
    )
    t_start = time.perf_counter() - t0
    print(f"[engine] started in {t_start:.1f} s")

    count = not args.no_count
    if count:
        print("[encoder-count]", llm.collective_rpc(_install_encoder_counter))

    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    tok = llm.get_tokenizer()

    def run(seed: int) -> tuple[list[int], float]:
        prompt = {"prompt": PROMPT, "multi_modal_data": {"image": make_image(seed)}}
        t = time.perf_counter()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        dt = time.perf_counter() - t
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        lps = [round(lp[i].logprob, 3) for i, lp in zip(ids, comp.logprobs, strict=True)]
        enc = f" encoder={llm.collective_rpc(_read_encoder_counter)[0]}" if count else ""
        print(f"[image seed={seed}] {dt * 1000:.0f} ms prompt_len={len(out.prompt_token_ids)}{enc}")
        print(f"    token_ids = {ids}")
        print(f"    tokens    = {tok.convert_ids_to_tokens(ids)}")
        print(f"    logprobs  = {lps}")
        return ids, dt

    results = {}
    times = []
    for seed in IMAGE_SEEDS:
        results[seed], dt = run(seed)
        times.append(dt)
    again, dt = run(IMAGE_SEEDS[0])
    times.append(dt)

    distinct = len({tuple(v) for v in results.values()})
    print(f"[check] distinct outputs for {len(IMAGE_SEEDS)} images: {distinct}")
    print(f"[check] image {IMAGE_SEEDS[0]} repeat identical: {again == results[IMAGE_SEEDS[0]]}")
    print(
        f"[timing] engine start {t_start:.1f} s; per request "
        f"{', '.join(f'{t * 1000:.0f}' for t in times)} ms"
    )
    ok = distinct == len(IMAGE_SEEDS) and again == results[IMAGE_SEEDS[0]]
    print("[result]", "OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
