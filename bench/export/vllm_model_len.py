"""vLLM 0.32 drafts only while the batch's longest sequence + a DFlash block fits max_model_len.

    .venv-vllm/bin/python bench/export/vllm_model_len.py TARGET EXPORT PROMPTS.json MAX_TOKENS LEN [LEN ...]

Serves TARGET with EXPORT (greedy, fp32, num_speculative_tokens = block_size - 1) once per
max_model_len LEN and prints, per LEN, how many times the DFlash proposer ran, vLLM's counters
and τ (1 + accepted / drafts), and each prompt's last accepted counts. Steps where the model
runner skipped the drafter (``_input_fits_in_drafter``) still count as drafted, 0 accepted.
docs/export.md ("Engine length") has the figures for the bench drafter.
"""

import json
import os
import subprocess
import sys


def one(target: str, export: str, prompts: list, max_tokens: int, length: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the proposer runs in this process: count its calls
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.v1.spec_decode import dflash

    calls = [0]
    orig = dflash.DFlashProposer.propose

    def counted(self, *a, **k):
        calls[0] += 1
        return orig(self, *a, **k)

    dflash.DFlashProposer.propose = counted
    with open(os.path.join(export, "config.json")) as fh:
        num_spec = int(json.load(fh)["block_size"]) - 1
    llm = LLM(model=target, skip_tokenizer_init=True, dtype="float32", max_model_len=length, enforce_eager=True,
              seed=0, disable_log_stats=False, per_request_spec_decode_metrics="detailed",
              speculative_config={"method": "dflash", "model": export, "num_speculative_tokens": num_spec})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False),
                        use_tqdm=False)
    c = {m.name: int(m.value) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num_")
         and hasattr(m, "value")}
    return {"max_model_len": length, "proposer_calls": calls[0], "counters": c,
            "tau": 1 + c["vllm:spec_decode_num_accepted_tokens"] / c["vllm:spec_decode_num_drafts"],
            "last_steps_accepted": [o.outputs[0].spec_decode_metrics.to_dict()["per_step_accepted"][-3:] for o in outs]}


def main(argv: list[str]) -> int:
    target, export, prompts_file, max_tokens, *lengths = argv
    if len(lengths) == 1:
        with open(prompts_file) as fh:
            print(json.dumps(one(target, export, json.load(fh), int(max_tokens), int(lengths[0]))))
        return 0
    for length in lengths:  # one engine per process: vLLM keeps global state
        subprocess.run([sys.executable, __file__, target, export, prompts_file, max_tokens, length], check=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 6 or sys.argv[1].startswith("-"):
        print(__doc__.split("\n\n")[1])  # the usage line
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    sys.exit(main(sys.argv[1:]))
