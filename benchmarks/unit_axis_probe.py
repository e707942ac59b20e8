"""Which Triton reductions over a unit axis the GPU computes wrongly (H200 12-01: the attention seed walking one
key a step — scores a (16, 1) tile — was 7x off fp64 on the GPU and exact in the interpreter). Each kernel below
is one reduction the μGraph codegen emitted before ``ugraph_triton.reduction`` dropped reductions over unit
axes; each is checked against torch on random inputs and the maximum error printed.

    python benchmarks/unit_axis_probe.py        # CUDA GPU
"""
import torch
import triton
import triton.language as tl


@triton.jit
def max_unit(x_ptr, o_ptr):                  # tl.max of a (16, 1) tile along its unit axis
    r = tl.arange(0, 16)
    x = tl.load(x_ptr + r[:, None] + tl.arange(0, 1)[None, :])
    tl.store(o_ptr + r[:, None] + tl.arange(0, 1)[None, :], tl.max(x, axis=1, keep_dims=True))


@triton.jit
def sum_unit_mid(p_ptr, v_ptr, o_ptr):       # P·V over one key: (16, 1, 1) * (1, 1, 64) summed along axis 1
    r, c = tl.arange(0, 16), tl.arange(0, 64)
    p = tl.load(p_ptr + r[:, None] + tl.arange(0, 1)[None, :])
    v = tl.load(v_ptr + tl.arange(0, 1)[:, None] * 64 + c[None, :])
    tl.store(o_ptr + r[:, None] * 64 + c[None, :], tl.sum(p[:, :, None] * v[None, :, :], axis=1))


@triton.jit
def sum_wide_unit_rows(q_ptr, k_ptr, o_ptr):  # QKᵀ of one key: (16, 1, 64) summed along its 64
    r, c = tl.arange(0, 16), tl.arange(0, 64)
    q = tl.load(q_ptr + r[:, None] * 64 + c[None, :])
    k = tl.load(k_ptr + tl.arange(0, 1)[:, None] * 64 + c[None, :])
    tl.store(o_ptr + r[:, None] + tl.arange(0, 1)[None, :], tl.sum(q[:, None, :] * k[None, :, :], axis=2))


@triton.jit
def loop_unit(q_ptr, k_ptr, o_ptr, n):        # the online max over n one-key steps, pipelined loads
    r, c = tl.arange(0, 16), tl.arange(0, 64)
    q = tl.load(q_ptr + r[:, None] * 64 + c[None, :])
    m = tl.full((16, 1), -3e38, tl.float32)
    for it in tl.range(0, n, num_stages=3):
        k = tl.load(k_ptr + (it + tl.arange(0, 1))[:, None] * 64 + c[None, :])
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        m = tl.maximum(m, tl.max(s, axis=1, keep_dims=True))
    tl.store(o_ptr + r[:, None] + tl.arange(0, 1)[None, :], m)


def main() -> None:
    dev = "cuda"
    x = torch.randn(16, 1, device=dev)
    o = torch.empty_like(x)
    max_unit[(1,)](x, o)
    print(f"max over a unit axis      max error {(o - x).abs().max().item():.3e}")
    p, v = torch.randn(16, 1, device=dev), torch.randn(1, 64, device=dev)
    o = torch.empty(16, 64, device=dev)
    sum_unit_mid[(1,)](p, v, o)
    print(f"sum over a unit mid axis  max error {(o - p @ v).abs().max().item():.3e}")
    q, k = torch.randn(16, 64, device=dev), torch.randn(1, 64, device=dev)
    o = torch.empty(16, 1, device=dev)
    sum_wide_unit_rows[(1,)](q, k, o)
    print(f"sum (16, 1, 64) along 64  max error {(o - q @ k.T).abs().max().item():.3e}")
    ks = torch.randn(67, 64, device=dev)
    loop_unit[(1,)](q, ks, o, 67)
    want = (q @ ks.T).amax(1, keepdim=True)
    print(f"online max, one key/step  max error {(o - want).abs().max().item():.3e}")


if __name__ == "__main__":
    main()
