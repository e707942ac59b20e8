"""What a plain Triton GEMV reaches on this GPU: y = x @ W.T, W (n, k) bf16, x (m, k), m = 1 / 8."""
import itertools, sys, torch, triton, triton.language as tl
sys.path.insert(0, '.')
from torch_mirage.timing import cuda_graph_time_us, rotated_input_sets

@triton.jit
def gemv(x_ptr, w_ptr, y_ptr, K, N, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M)
    acc = tl.zeros((M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :]).to(tl.float32)
        x = tl.load(x_ptr + m[:, None] * K + k[None, :]).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(y_ptr + m[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty))

@triton.jit
def gemv_splitk(x_ptr, w_ptr, y_ptr, K, N, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    pid = tl.program_id(0); s = tl.program_id(1)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M)
    acc = tl.zeros((M, BLOCK_N), tl.float32)
    per = K // SPLIT
    for k0 in range(s * per, (s + 1) * per, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :]).to(tl.float32)
        x = tl.load(x_ptr + m[:, None] * K + k[None, :]).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.atomic_add(y_ptr + m[:, None] * N + n[None, :], acc)

l2 = 50 << 20
for (M, K, N) in [(1, 4096, 4096), (1, 4096, 28672), (1, 14336, 4096), (8, 4096, 4096)]:
    x = torch.randn(M, K, device='cuda', dtype=torch.bfloat16)
    w = torch.randn(N, K, device='cuda', dtype=torch.bfloat16) / 64
    sets = rotated_input_sets([x, w], l2)
    floor = (N * K * 2) / 3.0e12 * 1e6
    ref = x.float() @ w.float().t()
    t_cublas = cuda_graph_time_us(lambda a, b: torch.nn.functional.linear(a, b), sets)
    print(f"M{M} K{K} N{N}: floor {floor:.1f} us, cuBLAS {t_cublas:.1f} us", flush=True)
    res = []
    for bn, bk, warps, stages in itertools.product((8, 16, 32, 64), (128, 256, 512), (4, 8), (3,)):
        if M * bn * bk > 32768: continue
        y = torch.empty(M, N, device='cuda', dtype=torch.bfloat16)
        f = lambda a, b: gemv[(N // bn,)](a, b, y, K, N, M=M, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        try:
            f(x, w); torch.cuda.synchronize()
            err = (y.float() - ref).abs().max().item()
            t = cuda_graph_time_us(f, sets)
        except Exception as e:
            continue
        res.append((t, f"bn{bn} bk{bk} w{warps} s{stages} grid{N // bn} err{err:.2g}"))
    for split in (2, 4, 8):
      for bn, bk, warps in itertools.product((32, 64), (256,), (4,)):
        if M * bn * bk > 32768 or (K // split) % bk: continue
        y = torch.zeros(M, N, device='cuda', dtype=torch.float32)
        f = lambda a, b: (y.zero_(), gemv_splitk[(N // bn, split)](a, b, y, K, N, M=M, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, num_warps=warps, num_stages=3))
        try:
            f(x, w); torch.cuda.synchronize()
            t = cuda_graph_time_us(f, sets)
        except Exception as e:
            print('fail', e); continue
        res.append((t, f"splitK{split} bn{bn} bk{bk} w{warps} grid{N // bn}x{split}"))
    res.sort()
    for t, d in res[:6]:
        print(f"   {t:7.1f} us  {floor / t:.2f} of floor  {d}", flush=True)
