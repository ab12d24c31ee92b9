"""Serve a target with a DFlash export as its drafter in vLLM and report what vLLM counted.

Runs under vLLM's own interpreter (``.venv-vllm/bin/python trainer/serve/vllm_serve.py REQUEST``,
started by trainer/serve/served.py), never in the trainer's venv: it imports vLLM and the standard
library only, so vLLM's torch and transformers pins never meet ours.

REQUEST is a JSON file: ``target``, ``export`` (null: the target alone), ``prompts`` (lists of
token ids), ``max_tokens``, ``num_speculative_tokens``, ``dtype``. The answer, one JSON line
on stdout after ``SERVED-JSON``: per prompt the output token ids and vLLM's per-request
acceptance record (``per_step_accepted``: draft tokens accepted at each verify step), and
vLLM's own engine-wide counters from ``LLM.get_metrics()``
(``vllm:spec_decode_num_drafts``, ``…_num_draft_tokens``, ``…_num_accepted_tokens``).
"""

from __future__ import annotations

import json
import os
import sys

MARK = "SERVED-JSON "
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")


def serve(req: dict) -> dict:
    from vllm import LLM, SamplingParams

    kw = {}
    if req.get("export"):
        kw["speculative_config"] = {"method": "dflash", "model": req["export"],
                                    "num_speculative_tokens": int(req["num_speculative_tokens"])}
        # per-request counts, step by step: the rounds can be set beside the evaluator's
        kw["per_request_spec_decode_metrics"] = "detailed"
    llm = LLM(model=req["target"], skip_tokenizer_init=True, dtype=req.get("dtype", "float32"),
              max_model_len=int(req["max_model_len"]), enforce_eager=True, seed=0,
              disable_log_stats=False, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]), ignore_eos=True,
                            detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], params, use_tqdm=False)
    runs = []
    for o in outs:
        c = o.outputs[0]
        m = c.spec_decode_metrics.to_dict() if getattr(c, "spec_decode_metrics", None) is not None else None
        runs.append({"tokens": list(c.token_ids), "spec": m})
    counters = {}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            counters[metric.name] = int(getattr(metric, "value", 0))
    return {"runs": runs, "counters": counters}


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as fh:
        req = json.load(fh)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the tiny pairs need a few MiB
    result = serve(req)
    sys.stdout.write(MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
