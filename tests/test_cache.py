"""The on-disk cache: keys, integrity, atomicity under concurrent writers."""
import logging
import multiprocessing as mp
import os
import stat

import pytest

from torch_mirage.cache import DiskCache, cache_key


def test_roundtrip_and_missing(tmp_path):
    cache = DiskCache(str(tmp_path))
    key = cache_key(graph="g", shapes=[[2, 3]], dtype="float16")
    assert cache.get(key) is None
    cache.put_json(key, {"tile": [64, 128]})
    assert cache.get_json(key) == {"tile": [64, 128]}


def test_key_depends_on_every_part():
    base = dict(graph="g", shapes=[[2, 3]], dtype="float16", device="cuda:H100", config={"fallback": "inductor"})
    keys = {cache_key(**base)}
    for part, other in [("graph", "h"), ("shapes", [[2, 4]]), ("dtype", "bfloat16"), ("device", "cuda:A100"),
                        ("config", {"fallback": "eager"})]:
        keys.add(cache_key(**{**base, part: other}))
    assert len(keys) == 6
    assert cache_key(**base) == cache_key(**dict(reversed(list(base.items()))))


def test_corrupt_and_truncated_entries_are_ignored_and_rewritten(tmp_path):
    cache = DiskCache(str(tmp_path))
    key = cache_key(x=1)
    path = cache.put(key, b"payload-bytes" * 100)
    with open(path, "r+b") as f:            # flip a byte in the payload
        f.seek(-5, os.SEEK_END)
        f.write(b"X")
    assert cache.get(key) is None
    cache.put(key, b"fresh")
    assert cache.get(key) == b"fresh"
    with open(path, "r+b") as f:            # truncate
        f.truncate(20)
    assert cache.get(key) is None
    with open(path, "wb") as f:             # garbage
        f.write(b"not a cache entry")
    assert cache.get(key) is None


def _writer(root, key, n, tag):
    cache = DiskCache(root)
    for i in range(n):
        cache.put(key, (tag * 1000 + str(i)).encode())


def test_concurrent_writers_leave_a_whole_entry(tmp_path):
    key = cache_key(concurrent=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), key, 200, tag)) for tag in "ab"]
    for p in procs:
        p.start()
    reads = []
    cache = DiskCache(str(tmp_path))
    while any(p.is_alive() for p in procs):
        got = cache.get(key)
        if got is not None:
            reads.append(got)
    for p in procs:
        p.join()
        assert p.exitcode == 0
    for got in reads + [cache.get(key)]:
        assert got[:1000] in (b"a" * 1000, b"b" * 1000) and got[1000:].isdigit()
    leftovers = [f for _, _, files in os.walk(tmp_path) for f in files if f.startswith(".tmp-")]
    assert leftovers == []


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_files_and_directories_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        path = DiskCache(str(tmp_path / "c")).put(cache_key(mode=umask), b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o777 & ~umask


KERNEL_SOURCE = "def answer():\n    return 41 + 1   # μ: a non-ASCII character, as generated kernels have\n"


@pytest.mark.parametrize("damage", ["random bytes", "truncated", "truncated inside a character", "empty"])
def test_a_damaged_kernel_source_is_dropped_and_rewritten(tmp_path, monkeypatch, caplog, damage):
    from torch_mirage.codegen import loader

    module, path = loader.load_source(KERNEL_SOURCE, str(tmp_path))
    assert module.answer() == 42 and path.startswith(str(tmp_path / "kernels"))
    data = KERNEL_SOURCE.encode()
    cut = data.index("μ".encode()) + 1
    broken = {"random bytes": os.urandom(200), "truncated": data[:20], "truncated inside a character": data[:cut],
              "empty": b""}[damage]
    with open(path, "wb") as f:
        f.write(broken)
    monkeypatch.setattr(loader, "_LOADED", {})          # a later process: nothing memoized
    with caplog.at_level(logging.WARNING, logger="torch_mirage"):
        module, again = loader.load_source(KERNEL_SOURCE, str(tmp_path))
        loader._LOADED.clear()
        loader.load_source(KERNEL_SOURCE, str(tmp_path))   # whole again: no second line
    assert again == path and module.answer() == 42
    with open(path, "rb") as f:
        assert f.read() == data
    (line,) = [r.getMessage() for r in caplog.records]
    assert path in line and "corrupt or truncated" in line and "rewritten" in line
    assert not [f for f in os.listdir(os.path.dirname(path)) if f.startswith(".tmp-")]


def test_a_damaged_stitch_kernel_is_regenerated_not_left_to_inductor(tmp_path, monkeypatch, caplog):
    """A corrupted entry under kernels/ used to fail its region on every later run; now the next compile
    rewrites it and the region is still mirage's."""
    import torch

    import torch_mirage
    from torch_mirage.codegen import loader
    from helpers import assert_close

    fn = lambda x: torch.softmax(x * 2, dim=-1) + 1
    x = torch.randn(4, 32)

    def compile_once():
        torch._dynamo.reset()
        report = torch_mirage.Report()
        backend = torch_mirage.MirageBackend(options={"cache_dir": str(tmp_path)}, report=report)
        assert_close(torch.compile(fn, backend=backend)(x), fn(x))
        return report

    first = compile_once()
    (kernel,) = [r.info["kernel_source"] for r in first.regions if r.compiled_by == "mirage"]
    with open(kernel, "wb") as f:
        f.write(os.urandom(300))
    monkeypatch.setattr(loader, "_LOADED", {})
    with caplog.at_level(logging.WARNING, logger="torch_mirage"):
        second = compile_once()
    assert [r.compiled_by for r in second.regions] == [r.compiled_by for r in first.regions]
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and kernel in lines[0], lines


def test_source_digest_names_the_code_it_covers():
    """A negative cache entry's code digest (cache.source_digest): stable for the same parts, another for more code,
    and a module that is not there is an error, not a silent digest of nothing."""
    from torch_mirage.cache import source_digest

    assert source_digest("superopt") == source_digest("superopt")
    assert len({source_digest("superopt"), source_digest("superopt", "ugraph.py"), source_digest("capture")}) == 3
    with pytest.raises(FileNotFoundError):
        source_digest("no_such_module.py")


def test_process_memo_keeps_the_recently_used_answers():
    from torch_mirage.cache import ProcessMemo

    memo, made = ProcessMemo(2), []
    get = lambda k: memo.get(k, lambda: made.append(k) or k * 10)   # noqa: E731
    assert [get(1), get(2), get(1)] == [10, 20, 10] and made == [1, 2]
    get(3)                                        # 2 is the least recently used: dropped
    assert get(1) == 10 and made == [1, 2, 3]
    get(2)
    assert made == [1, 2, 3, 2]
