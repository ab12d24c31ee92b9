import torch
from vllm import _custom_ops as ops
torch.manual_seed(0)
L, n, nkv, hd = 3, 5, 2, 32
x = torch.randn(L, n, nkv, hd)
w = torch.randn(L, hd)
out = torch.empty_like(x)
ops.rms_norm(out, x, w.contiguous(), 1e-6)
def ref(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
for i in range(L):
    own = ref(x[i], w[i]); first = ref(x[i], w[0])
    print(i, "own-weight max err", (out[i]-own).abs().max().item(), "layer0-weight max err", (out[i]-first).abs().max().item())
