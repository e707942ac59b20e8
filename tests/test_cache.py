"""The on-disk cache: keys, integrity, atomicity under concurrent writers."""
import multiprocessing as mp
import os

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
