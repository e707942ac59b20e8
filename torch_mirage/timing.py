"""Timing and test data on a device: µs per call of a function replayed in a CUDA graph over input sets rotated
past L2 (or launched from Python), alternating halves and their estimates, and random inputs shaped like a tensor meta.
The one home of "how long does this take" for the tuner (superopt.launch), the claimers, the region and
whole-graph guards (runtime) and the bench; it depends on nothing else of the package."""
from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Sequence

import torch


def random_like(meta, device=None) -> torch.Tensor:
    """Real-valued test data for a TensorMeta: normal floats, small non-negative ints (distinct in a short vector),
    random bools."""
    device = device or meta.device
    shape, dtype = tuple(meta.shape), meta.dtype
    if dtype.is_floating_point:
        t = torch.randn(shape, device=device, dtype=torch.float32).to(dtype)
    elif dtype == torch.bool:
        t = torch.rand(shape, device=device) > 0.5
    elif len(shape) == 1 and 1 < shape[0] <= 8:     # positions (a cache write's): distinct, as an index needs
        t = torch.randperm(8, device=device)[:shape[0]].to(dtype)
    else:
        t = torch.randint(0, 8, shape, device=device, dtype=dtype)
    if not meta.is_contiguous and all(s > 0 for s in shape):
        # the meta's strides; a dim of stride 0 (an expanded tensor, a mask broadcast over the batch) holds one value
        base = tuple(1 if st == 0 else n for n, st in zip(shape, meta.stride))
        t = torch.empty_strided(base, meta.stride, device=device, dtype=dtype).copy_(
            t[tuple(slice(0, n) for n in base)]).expand(shape)
    return t


REPEAT_MS = 100.0   # a repeat of a fixed replay count runs at most about this long (one replay at least)


def replays_within(replays: int, one_ms: float, longest_ms: float = REPEAT_MS) -> int:
    """``replays``, cut so that a repeat of them takes about ``longest_ms`` at most where one takes ``one_ms``
    (never below one). A call that long averages its own noise: the count is for µs-long calls, and a candidate
    that is hopelessly slow (an attention seed's one-key, one-row schedule at a 1031-token prompt: 16 input sets of
    ~10 ms a replay) would spend seconds of the compile being timed to that count."""
    return max(1, min(replays, math.floor(longest_ms / max(one_ms, 1e-6))))


def _repeated_timing(run_once: Callable[[], Any], calls_per_run: int, replays: int | None, target_ms: float | None,
                     repeats: int) -> dict:
    """Time ``run_once`` ``replays`` times per repeat (fewer where that would run past :data:`REPEAT_MS`, see
    :func:`replays_within`; or as often as fills ``target_ms``): µs per call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run_once()
    start.record()
    run_once()
    end.record()
    end.synchronize()
    one_ms = start.elapsed_time(end)
    if replays is None:
        replays = max(1, math.ceil((target_ms or 10.0) / max(one_ms, 1e-3)))
    else:
        replays = replays_within(replays, one_ms)
    per_call = []
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            run_once()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / (replays * calls_per_run))
    return {"us": statistics.median(per_call), "us_min": min(per_call), "us_max": max(per_call),
            "replays": replays, "repeats": repeats, "sets": calls_per_run, "samples": per_call}


_SIDE_STREAMS: dict[int, Any] = {}


def side_stream(device: Any = None) -> "torch.cuda.Stream":
    """The one side stream per device on which mirage warms a function up before capturing it (Triton's JIT and
    Inductor's autotuning run there, outside the capture). One stream, not ``torch.cuda.Stream()`` each time:
    cuBLAS keeps a workspace for every stream it has run a matmul on until the process ends (``memory_allocated``
    counts it, ``empty_cache`` does not free it), and ``torch.cuda.Stream()`` hands out the pool's 32 streams in
    turn, so fresh streams for each tuning run and capture leave up to 32 workspaces behind."""
    index = None if device is None else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    return _SIDE_STREAMS[index]


def cuda_graph_timing(fn: Callable[..., Any], input_sets: Sequence[Sequence[Any]], *, replays: int | None = None,
                      target_ms: float | None = None, repeats: int = 5) -> dict:
    """µs per call of ``fn`` in one CUDA graph that calls it once per input set (warmed up on a side stream, so
    compilation and autotuning happen before capture), replayed ``replays`` times per repeat or for about
    ``target_ms``; median, min and max over the repeats."""
    stream = side_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for inputs in input_sets:
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for inputs in input_sets:
            fn(*inputs)
    try:
        return _repeated_timing(graph.replay, len(input_sets), replays, target_ms, repeats)
    finally:
        del graph


def plain_timing(fn: Callable[..., Any], inputs: Sequence[Any], *, replays: int | None = None,
                 target_ms: float = 10.0, repeats: int = 5) -> dict:
    """µs per call of ``fn(*inputs)`` launched from Python, no CUDA graph (for what cannot be captured, and for
    calls long enough that launching does not count)."""
    return _repeated_timing(lambda: fn(*inputs), 1, replays, target_ms, repeats)


def pooled_median(halves: Sequence[Sequence[float]]) -> float:
    """One time of a candidate's halves of samples: the median of all of them."""
    return statistics.median([x for half in halves for x in half])


def fastest_per_half(halves: Sequence[Sequence[float]]) -> float:
    """One time of a host-launched candidate's halves: each half's fastest sample, averaged over the halves.
    What the host adds (a busy core, a page fault, the allocator) makes samples slower, never faster, so a half's
    fastest sample is its least disturbed one; averaging the A and the B A halves keeps the schedule's balance
    of clock and temperature drift (the fastest of all samples would favour the candidate timed first). On the
    H200 two decode graphs of one HF model, alike in their kernels, were timed 5 % apart in opposite directions by
    the median of four samples (mistral, 2026-11-28)."""
    return statistics.fmean(min(half) for half in halves if half)


HOPELESS = 4.0   # a tuning candidate whose first half is this many times the best first half gets no second


def alternating_times(names: Sequence[str], time_half: Callable[[str], list[float]],
                      on_error: Callable[[str, Exception], None] | None = None,
                      estimate: Callable[[list[list[float]]], float] = pooled_median,
                      hopeless: float | None = None) -> dict[str, float]:
    """µs per call of each named candidate, timed in the order A B … B A by ``time_half(name)`` (which returns
    per-call samples): the GPU's clock and temperature drift between back-to-back timings, and each candidate
    then meets the drift alike. ``estimate`` makes one time of a candidate's halves of samples
    (:func:`pooled_median`, or :func:`fastest_per_half` for timings launched from Python). A candidate whose
    timing raises is dropped when ``on_error`` is given (and told), else the error propagates.

    ``hopeless``: a candidate whose first half's median is more than this many times the fastest first half's
    is not timed a second time (its time is its first half's): drift is a few percent, so it cannot win, and a
    slow candidate's half is the longest of the schedule (an attention seed's one-key, one-row schedule at a
    1031-token prompt: 45 ms a call, seconds a half). ``None`` (the bench, which reports every time): all twice."""
    halves: dict[str, list[list[float]] | None] = {name: [] for name in names}
    for k, name in enumerate([*names, *reversed(names)]):
        if halves[name] is None:
            continue
        if k >= len(names) and hopeless is not None and _far_behind(halves, name, hopeless):
            continue
        try:
            halves[name].append(list(time_half(name)))
        except Exception as e:
            if on_error is None:
                raise
            on_error(name, e)
            halves[name] = None
    return {name: estimate(got) for name, got in halves.items() if got and any(got)}


def _far_behind(halves: dict[str, list[list[float]] | None], name: str, factor: float) -> bool:
    """Whether ``name``'s first half of samples is more than ``factor`` times the fastest first half's median."""
    firsts = {n: statistics.median(got[0]) for n, got in halves.items() if got and got[0]}
    return name in firsts and firsts[name] > factor * min(firsts.values())


def cuda_graph_time_us(fn: Callable[..., Any], input_sets: Sequence[Sequence[Any]], replays: int = 20,
                       repeats: int = 5) -> float:
    """Median µs per call of :func:`cuda_graph_timing`."""
    return cuda_graph_timing(fn, input_sets, replays=replays, repeats=repeats)["us"]


def rotated_input_sets(inputs: Sequence[Any], l2_bytes: int, max_sets: int = 64) -> list[list[Any]]:
    """Enough copies of ``inputs`` that one pass over them touches more than 3× L2 (one set, not copied twice,
    when it is that large by itself: a 2 GiB logits region needs no second copy)."""
    nbytes = sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor)) or 1
    count = max(1, min(max_sets, -(-3 * l2_bytes // nbytes)))
    if count == 1:
        return [list(inputs)]   # the inputs themselves: no copy of a set that large
    return [[strided_copy(t) if isinstance(t, torch.Tensor) else t for t in inputs] for _ in range(count)]


def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its sizes and strides, gaps and stride-0 (expanded) dims included: a callee compiled
    for ``t``'s layout checks strides (Inductor's ``assert_size_stride``), and ``clone`` makes a non-dense tensor
    contiguous (a mask expanded over the batch, stride 0: Inductor's version of a b8 decode attention region
    failed every timing with that). Copies the span of memory ``t`` covers, once."""
    if t.numel() == 0 or is_dense(t):
        return t.clone()                          # keeps a dense tensor's strides
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.as_strided((span,), (1,), t.storage_offset()).clone().as_strided(t.shape, t.stride())


def timing_input_sets(args: Sequence[Any], l2_bytes: int) -> list[list[Any]]:
    """:func:`rotated_input_sets` of a caller's real arguments where a copy is the same input to the callee:
    every tensor dense and non-overlapping (``clone`` keeps its strides) and no two sharing storage (a copy
    would break the aliasing). Otherwise, or without the memory for the copies, the arguments themselves."""
    tensors = [t for t in args if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    if len(storages) != len(tensors) or not all(is_dense(t) for t in tensors):
        return [list(args)]
    try:
        return rotated_input_sets(args, l2_bytes)
    except torch.cuda.OutOfMemoryError:
        return [list(args)]


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory once in some order of dims (what ``clone`` reproduces)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def count_device_kernels(fn: Callable[..., Any], *inputs: Any) -> int | None:
    """How many GPU kernels one call of ``fn(*inputs)`` launches (copies and memsets not counted), read from the
    profiler's device activity; kernels a CUDA graph replays are counted too where CUPTI reports them. None off
    CUDA, or where the call launched a CUDA graph and the profiler saw none of its kernels (it cannot tell)."""
    return kernel_total(device_activity(fn, *inputs))


def kernel_total(found: list[tuple[str, float]] | None) -> int | None:
    """How many of :func:`device_activity`'s entries are kernels (copies and memsets are not)."""
    return None if found is None else sum(not _is_copy(name) for name, _ in found)


def _is_copy(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset", "[memory]"))


def device_activity(fn: Callable[..., Any], *inputs: Any) -> list[tuple[str, float]] | None:
    """The GPU activity of one call of ``fn(*inputs)`` in launch order: (kernel / copy name, device µs) per
    entry (see :func:`count_device_kernels`); None off CUDA or where a CUDA graph launch showed no kernel."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(*inputs)
        torch.cuda.synchronize()
    found, graph_launches = [], 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            found.append((e.name, float(getattr(e, "device_time", 0.0) or 0.0)))
        elif e.name == "cudaGraphLaunch":
            graph_launches += 1
    return None if graph_launches and not kernel_total(found) else found


def activity_table(found: list[tuple[str, float]] | None, top: int = 40) -> list[dict] | None:
    """:func:`device_activity` grouped by name (a kernel name cut at 80 characters): calls and total µs, the
    most time first, ``top`` rows."""
    if found is None:
        return None
    rows: dict[str, list] = {}
    for name, us in found:
        row = rows.setdefault(name[:80], [0, 0.0])
        row[0] += 1
        row[1] += us
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": k, "calls": c, "us": round(t, 2)} for k, (c, t) in ranked]
