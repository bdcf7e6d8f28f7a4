"""One real vLLM engine on CPU, as a separate process, for the end-to-end tests.

    python -m tests.vllm.engine_run MODEL --images 10,11 [--socket URI --role ec_both]
                                    [--pause-after N]

Generates greedily for each image seed (the tiny PaliGemma of tiny_model.py),
counting the images the vision encoder really ran on in the worker process,
and prints one line `RESULT {json}`. With --pause-after N it prints `PAUSED`
after N images and waits for a line on stdin (the test kills the daemon then).
Without --socket the engine has no EC connector (the reference run).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tests.vllm.run_tiny_engine import (
    PROMPT,
    _install_encoder_counter,
    _read_encoder_counter,
    make_image,
)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--images", required=True)
    parser.add_argument("--socket", default="")
    parser.add_argument("--role", default="ec_both")
    parser.add_argument("--pause-after", type=int, default=0)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    extra: dict[str, Any] = {}
    if args.socket:
        extra["ec_transfer_config"] = {
            "ec_connector": "ECDaemonConnector",
            "ec_connector_module_path": "ec_client.vllm_connector",
            "ec_role": args.role,
            "ec_connector_extra_config": {"ec_daemon_socket": args.socket,
                                          "ec_daemon_copy_backend": "cpu"}}
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=128, max_num_seqs=4, limit_mm_per_prompt={"image": 1}, seed=0,
              **extra)
    llm.collective_rpc(_install_encoder_counter)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    results = {}
    for i, seed in enumerate(int(s) for s in args.images.split(",")):
        if args.pause_after and i == args.pause_after:
            print("PAUSED", flush=True)
            sys.stdin.readline()
        prompt = {"prompt": PROMPT, "multi_modal_data": {"image": make_image(seed)}}
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        results[seed] = {"tokens": tokens,
                         "logprobs": [lp[t].logprob for t, lp in zip(tokens, completion.logprobs,
                                                                     strict=True)],
                         "finish_reason": completion.finish_reason}
    counts = llm.collective_rpc(_read_encoder_counter)
    print("RESULT " + json.dumps({"results": results,
                                  "encoder_images": sum(c["images"] for c in counts)}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
