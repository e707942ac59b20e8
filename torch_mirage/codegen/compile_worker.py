"""A compile worker process: compiles Triton kernels for a GPU target into Triton's on-disk cache, nothing else.

Run as a script (``python compile_worker.py``, by path: it imports triton and the standard library only, not
torch_mirage or torch, so it starts in a fraction of a second and never makes a CUDA context). It reads one JSON
request per line on stdin and answers one JSON line per request on stdout: ``{"ok": true}`` or
``{"ok": false, "error": "..."}``; it exits at the end of its input.

A request is what :func:`torch_mirage.codegen.aot.captured_compiles` recorded of a launch's compile in the parent:
the generated module's file, the kernel's name, Triton's ``specialization_data`` of that launch (the argument
specialisation and the parsed options, as ``JITFunction.preload`` reads it), the target and Triton's cache
directory. The worker compiles exactly what the launch would (same source file, signature, constants, attributes
and options, hence the same cache key), and the kernel's C launcher where Triton builds one per signature; the
parent's launch then finds both in the cache and only loads them.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys

_MODULES: dict[str, object] = {}


KERNEL_KEY_VERSION = "torch_mirage-kernel-key-1"


def pin_kernel_keys(module, source: str) -> None:
    """Give each ``@triton.jit`` function of generated ``module`` (whose text is ``source``) its cache key without
    Triton's dependency walk: a digest of the module's whole text, the function's name and its first line. A
    generated module imports only ``triton`` and ``triton.language`` and holds its constants as literals, so its
    text is all that its kernels depend on besides Triton itself (whose own digest is part of every compile's
    cache key). Triton otherwise parses and walks each function's source on its first launch in every process,
    about 6 ms a kernel (the CPU, Triton 3.7), which a warm compile of a decode graph pays for dozens of kernels.
    The loader and this worker both pin the keys, so the kernels they compile and load have the same key.
    Functions Triton's interpreter wraps (no ``cache_key``) are left alone."""
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()
    for name, fn in vars(module).items():
        if getattr(fn, "hash", 0) is not None or not hasattr(type(fn), "cache_key"):
            continue         # not a JITFunction, or one whose key is already known
        line = getattr(fn, "starting_line_number", 0)
        fn.hash = hashlib.sha256(f"{KERNEL_KEY_VERSION}|{digest}|{name}|{line}".encode()).hexdigest()


TRITON_KEY_FILE = "torch_mirage-triton-key-{}.txt"


def _triton_files_stamp(triton_dir: str) -> str:
    """A digest of the path, size and modification time of every file Triton's own ``triton_key`` reads (its
    ``runtime/cache.py``, the ``compiler``, ``backends`` and ``language`` packages and ``_C/libtriton``), with
    Triton's version: it changes whenever any of those files could have."""
    stamp = hashlib.sha256()
    parts = [os.path.join(triton_dir, "runtime", "cache.py")]
    for sub in ("compiler", "backends", "language"):
        for root, dirs, files in os.walk(os.path.join(triton_dir, sub)):
            dirs.sort()
            parts += [os.path.join(root, f) for f in sorted(files) if f.endswith(".py")]
    c_dir = os.path.join(triton_dir, "_C")
    parts += sorted(os.path.join(c_dir, f) for f in os.listdir(c_dir) if f.startswith("libtriton."))
    for path in parts:
        st = os.stat(path)
        stamp.update(f"{path}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return stamp.hexdigest()


def memoize_triton_key(cache_dir: str) -> bool:
    """Make Triton's ``triton_key`` (part of every kernel compile's cache key) come from a file in ``cache_dir``
    instead of its digest of Triton's files, which reads all of ``libtriton`` once a process: about 0.35 s on the
    H100's host (12-07), paid by every warm process on its first kernel load and by every compile worker. The file
    is named by :func:`_triton_files_stamp`, so an upgraded or edited Triton computes and writes a new one; the key
    itself is always Triton's own. Each module of :data:`TRITON_KEY_HOLDERS` loaded so far that holds Triton's
    function gets the memo in its place. Returns whether the memo is in place (False: this Triton has no such
    function, or its key is computed already, or the files cannot be read)."""
    try:
        import triton
        from triton.runtime import cache as triton_cache
    except ImportError:
        return False
    original = getattr(triton_cache, "triton_key", None)
    info = getattr(original, "cache_info", None)
    if getattr(original, "torch_mirage_memo", False):
        return True
    if info is None or info().currsize:   # not the lru-cached function we know, or already computed here
        return False
    try:
        stamp = _triton_files_stamp(os.path.dirname(os.path.abspath(triton.__file__)))
    except OSError:
        return False
    path = os.path.join(cache_dir, TRITON_KEY_FILE.format(stamp[:32]))
    memo: list[str] = []

    def triton_key() -> str:
        if not memo:
            try:
                with open(path, encoding="utf-8") as f:
                    key = f.read()
            except OSError:
                key = ""
            if not key.startswith(triton.__version__):   # Triton's key starts with its version: else not one
                key = original()
                _write_atomic_text(path, key)
            memo.append(key)
        return memo[0]

    triton_key.torch_mirage_memo = True
    triton_key.__wrapped__ = original
    for name in TRITON_KEY_HOLDERS:   # the modules that bound Triton's function by name when imported
        module = sys.modules.get(name)
        if module is not None and getattr(module, "triton_key", None) is original:
            module.triton_key = triton_key
    return True


# Where ``triton_key`` is bound by name: Triton's cache module (whose ``get_cache_key`` every compile calls), its
# autotuner, and Inductor's Triton shim, through which Inductor's FX graph cache and compile pool ask for it
# (torch 2.11-2.13). With the memo in Triton's module only, a warm process's first Inductor load hashed
# ``libtriton`` itself (H100 12-07 h: the prefill graph's warm assemble stage 1.19 s, 0.73 s on 12-03).
TRITON_KEY_HOLDERS = ("triton.runtime.cache", "triton.runtime.autotuner", "torch._inductor.runtime.triton_compat")


def _write_atomic_text(path: str, text: str) -> None:
    """``text`` into ``path`` through a temporary file and a rename; a write that fails leaves nothing behind
    (``torch_mirage.cache.write_atomic``'s job, here without importing torch_mirage: see the module's docstring)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _module(path: str):
    """The generated module at ``path``, imported once per worker (``@triton.jit`` reads its source by file)."""
    if path not in _MODULES:
        name = "torch_mirage_compile_worker_" + hashlib.sha256(path.encode()).hexdigest()[:16]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        with open(path, encoding="utf-8") as f:
            source = f.read()
        exec(compile(source, path, "exec"), module.__dict__)
        pin_kernel_keys(module, source)
        _MODULES[path] = module
    return _MODULES[path]


def _listed(value):
    """JSON's lists back to the tuples Triton had (signatures and options hold no lists)."""
    return tuple(_listed(v) for v in value) if isinstance(value, list) else value


def compile_request(request: dict) -> None:
    """Compile one recorded launch into Triton's cache (raises what Triton raises)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    triton.knobs.cache.dir = request["cache_dir"]
    memoize_triton_key(request["cache_dir"])
    fn = getattr(_module(request["path"]), request["name"])
    data = json.loads(request["specialization"])

    def constant(value):
        if isinstance(value, str) and tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(value["constexpr"])
        return value
    constexprs = {tuple(k): constant(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"]))
    signature = {k: _listed(v) for k, v in data["signature"].items()}
    options = {k: _listed(v) for k, v in data["options"].items()}
    backend, arch, warp_size = request["target"]
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(backend, arch, warp_size),
                            options=options)
    try:
        _build_launcher(kernel)
    except Exception:   # the kernel is compiled; the parent builds its launcher when it loads it, as it would anyway
        pass


def _build_launcher(kernel) -> None:
    """Where Triton builds a C launcher for each kernel signature the first time a kernel is loaded (its NVIDIA
    backend up to 3.6: ``make_launcher`` + ``compile_module_from_src``, a C compiler run), build it here: it lands
    in Triton's cache, so the parent's load finds it instead of running the C compiler itself, one launcher after
    another (H100, Triton 3.6: 38 launcher builds, 12.9 s of one decode graph's cold compile). Needs no CUDA
    context. Triton 3.7 has one launcher for every kernel: nothing to build."""
    from triton.backends.nvidia import driver as nvidia
    if hasattr(nvidia, "make_launcher"):
        nvidia.CudaLauncher(kernel.src, kernel.metadata)


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")   # the answers' own channel: whatever a compile prints goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            compile_request(json.loads(line))
            answer = {"ok": True}
        except Exception as e:   # the parent's own compile of this launch meets the error again and reports it
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
