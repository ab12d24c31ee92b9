"""DFlash2, loader level: load an export through vLLM's own DFlash2 classes and draft one block.

Runs under vLLM's interpreter (``.venv-vllm/bin/python trainer/serve/vllm_dflash2_check.py IN OUT``),
started by tests/test_served_vllm_dflash2.py. vLLM 0.32 serves DFlash2 only on its Triton
model runner (the CPU build has no Triton), so nothing here starts an engine: the config is
built by vLLM's ``EngineArgs`` (its V1-runner refusal of candidate-head drafts skipped — this
loads, it never serves), ``qwen3_dflash2.DFlash2Qwen3ForCausalLM`` is built and its
``load_weights`` reads the export's ``model.safetensors`` (the target's embedding and LM head
are set from the target, as the engine shares them; then its ``process_weights_after_loading``). Then one drafter forward: vLLM's
``DFlash2Qwen3Model.forward`` on [bonus, mask × (B−1)] with the context K/V made by its own
context path (``combine_hidden_states``, ``_project_context_kv``, ``_normalize_context_k``, its
RoPE kernel); only the attention kernel, which needs the engine's paged KV cache, is replaced
by SDPA over [context; block], non-causal, as DFlash attends. The drafted block: its
``compute_candidates`` (top-k), its ``CandidateSelector`` scores, and the greedy walk from the
anchor (ties to the larger unary logit). IN (torch.save): ``taps`` [n, taps·H], ``bonus``,
``target``, ``export``; OUT: ``hidden`` [B, H], ``candidates``, ``unary``, ``drafts``,
``params`` (the names vLLM loaded).
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.nn.functional as F


class ContextAttention(torch.nn.Module):
    """The block's queries over the context K/V and the block's own K/V, non-causal."""

    def __init__(self, ctx_k, ctx_v, num_heads, num_kv_heads, head_dim):
        super().__init__()
        self.ctx_k, self.ctx_v = ctx_k, ctx_v
        self.h, self.kvh, self.d = num_heads, num_kv_heads, head_dim

    def forward(self, q, k, v):
        n = q.shape[0]
        q = q.view(n, self.h, self.d).transpose(0, 1)
        k = torch.cat([self.ctx_k, k.view(n, self.kvh, self.d)]).transpose(0, 1)
        v = torch.cat([self.ctx_v, v.view(n, self.kvh, self.d)]).transpose(0, 1)
        rep = self.h // self.kvh
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0))
        return out.transpose(0, 1).reshape(n, self.h * self.d)


def main(argv: list[str]) -> int:
    from safetensors.torch import load_file
    from vllm import _custom_ops as ops
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    inp = torch.load(argv[0])
    target, export = inp["target"], inp["export"]
    with open(os.path.join(export, "config.json")) as fh:
        B = int(json.load(fh)["block_size"])
    VllmConfig._validate_v1_model_runner = lambda self: None  # load only: no model runner is started
    cfg = EngineArgs(model=target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256,
                     speculative_config={"method": "dflash", "model": export,
                                         "num_speculative_tokens": B - 1}).create_engine_config()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with set_current_vllm_config(cfg), torch.no_grad():
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(1, 1)
        from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

        m = DFlash2Qwen3ForCausalLM(vllm_config=cfg, prefix="").eval()
        m.load_weights((k, v.float()) for k, v in load_file(os.path.join(export, "model.safetensors")).items())
        tw = load_file(os.path.join(target, "model.safetensors"))
        emb, head = tw["model.embed_tokens.weight"], tw["lm_head.weight"]  # vLLM pads the vocabulary (to 64)
        m.model.embed_tokens.weight[:emb.shape[0]].copy_(emb.float())
        m.lm_head.weight[:head.shape[0]].copy_(head.float())
        # what vLLM's loader does after load_weights (the CPU linear layers' packed kernels)
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        process_weights_after_loading(m, cfg.speculative_config.draft_model_config, torch.device("cpu"))
        mdl = m.model

        taps = inp["taps"].float()
        n = taps.shape[0]
        ctx = m.combine_hidden_states(taps)
        L, nkv, hd = mdl._num_attn_layers, mdl._num_kv_heads, mdl._head_dim
        all_k, all_v = mdl._project_context_kv(ctx, n, L, nkv, hd)
        all_k = mdl._normalize_context_k(all_k)
        flat = all_k.view(L * n, nkv * hd)
        ops.rotary_embedding(torch.arange(n).repeat(L), flat, None, mdl._rope_head_size,
                             mdl._rope_cos_sin_cache.to(flat.dtype), mdl._rope_is_neox)
        all_k = flat.view(L, n, nkv, hd)
        for i, layer in enumerate(mdl.layers):
            a = layer.self_attn
            a.attn = ContextAttention(all_k[i], all_v[i], a.num_heads, a.num_kv_heads, a.head_dim)
        ids = torch.tensor([int(inp["bonus"])] + [mdl.mask_token_id] * (B - 1))
        hidden = mdl(ids, torch.arange(n, n + B))
        cand, unary = m.compute_candidates(hidden[1:])  # (token ids, logits), best first
        scores = mdl.candidate_selector(cand[None], unary[None], hidden[None, 1:],
                                        torch.tensor([int(inp["bonus"])]))[0]  # [slot, pred, cand]
        drafts, row = [], 0
        for i in range(B - 1):
            col = int(scores[i, row].argmax())  # first maximum: the larger unary logit on a tie
            drafts.append(int(cand[i, col]))
            row = col
    torch.save({"hidden": hidden, "candidates": cand, "unary": unary, "drafts": drafts,
                "params": sorted(n for n, _ in m.named_parameters())}, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
