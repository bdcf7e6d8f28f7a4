"""One real vLLM engine on CPU, as a separate process, for the end-to-end tests.

    python -m tests.vllm.engine_run MODEL --images 10,11,10 [--socket URI
        --role ec_both --copy-backend cpu --connector MODULE:CLASS
        --max-defer-seconds S --extra-config JSON | --transfer-config JSON]
        [--pause-after N] [--wait-start] [--hold-end]

Generates greedily for each image seed in turn, one request at a time (the
tiny PaliGemma of tiny_model.py), counting the images the vision encoder
really ran on in the worker process after each request, and prints one line
`RESULT {json}`: per request its image, tokens, logprobs, finish reason and
encoder images, or the error it raised. With --pause-after N it prints
`PAUSED` after N requests and waits for a line on stdin (the test acts on
the daemon then); with --wait-start it prints `STARTED` once built and waits
for a line before its first request (tests start engines at once); with
--hold-end it waits for a line after RESULT before it shuts down (a serving
engine outlives its saves; vLLM kills an engine 5 s into its shutdown). Without
--socket or --transfer-config the engine has no EC connector (the reference
run); --transfer-config is a whole `--ec-transfer-config`, used as given.
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

MAX_TOKENS = 8


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--images", required=True)
    parser.add_argument("--socket", default="")
    parser.add_argument("--role", default="ec_both")
    parser.add_argument("--copy-backend", default="cpu")
    parser.add_argument("--connector", default="ec_client.vllm_connector:ECDaemonConnector",
                        help="module:Class of the EC connector, or a name vLLM's factory "
                             "knows (no module path)")
    parser.add_argument("--pause-after", type=int, default=0)
    parser.add_argument("--wait-start", action="store_true")
    parser.add_argument("--hold-end", action="store_true")
    parser.add_argument("--max-defer-seconds", type=float, default=0)
    parser.add_argument("--extra-config", default="",
                        help="JSON object: more keys of the connector's extra config")
    parser.add_argument("--transfer-config", default="",
                        help="JSON object: the whole --ec-transfer-config, as given")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    extra: dict[str, Any] = {}
    if args.transfer_config:
        extra["ec_transfer_config"] = json.loads(args.transfer_config)
    elif args.socket:
        module, _, name = args.connector.rpartition(":")
        extra["ec_transfer_config"] = {
            "ec_connector": name,
            **({"ec_connector_module_path": module} if module else {}),
            "ec_role": args.role,
            "ec_connector_extra_config": {"ec_daemon_socket": args.socket,
                                          "ec_daemon_copy_backend": args.copy_backend}}
        if args.max_defer_seconds:
            extra["ec_transfer_config"]["ec_connector_extra_config"][
                "ec_daemon_max_defer_seconds"] = args.max_defer_seconds
        if args.extra_config:
            extra["ec_transfer_config"]["ec_connector_extra_config"].update(
                json.loads(args.extra_config))
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=128, max_num_seqs=4, limit_mm_per_prompt={"image": 1}, seed=0,
              **extra)
    llm.collective_rpc(_install_encoder_counter)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)

    def encoder_images() -> int:
        return sum(c["images"] for c in llm.collective_rpc(_read_encoder_counter))

    requests: list[dict[str, Any]] = []
    if args.wait_start:
        print("STARTED", flush=True)
        sys.stdin.readline()
    for i, seed in enumerate(int(s) for s in args.images.split(",")):
        if args.pause_after and i == args.pause_after:
            print("PAUSED", flush=True)
            sys.stdin.readline()
        prompt = {"prompt": PROMPT, "multi_modal_data": {"image": make_image(seed)}}
        try:
            before = encoder_images()
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            encoded = encoder_images() - before
        except Exception as exc:  # the engine failed the request, or died
            requests.append({"image": seed, "error": f"{type(exc).__name__}: {exc}"})
            continue
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        requests.append({
            "image": seed, "tokens": tokens,
            "logprobs": [lp[t].logprob for t, lp in zip(tokens, completion.logprobs or [],
                                                        strict=False)],
            "finish_reason": completion.finish_reason, "encoder_images": encoded,
            "ec_transfer_params": out.ec_transfer_params})
    print("RESULT " + json.dumps({"requests": requests}), flush=True)
    if args.hold_end:
        sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
