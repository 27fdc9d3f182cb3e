"""MetadataTable: the same answers as TTLCache (its model), in far less memory."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefs.paths import CachePath
from cachefs.store import metatable
from cachefs.store.metatable import MetadataTable
from cachefs.store.meta import ObjectMeta
from cachefs.store.objects import TTLCache


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def check_invariants(t: MetadataTable) -> None:
    """Every live row is reachable through the index from its key and in its directory's chain
    once; the counters add up."""
    recs = [t._row(r) for r in range(t._nrows)]  # hash, off, klen, vlen, df, ...
    live = [r for r, rec in enumerate(recs) if rec[4] & metatable._LIVE]
    assert t._live == len(live)
    assert t._live_bytes == sum(recs[r][2] + recs[r][3] for r in live)
    assert sorted(r for r in t._index if r >= 0) == live
    assert t._used == sum(1 for r in t._index if r != metatable._EMPTY)
    assert t._used <= metatable._MAX_LOAD * len(t._index)
    assert set(t._free).isdisjoint(live)
    for r in live:
        h, o, klen, _, df = recs[r][:5]
        _, found, _ = t._find(df >> metatable._FLAG_BITS, bytes(t._arena[o:o + klen]), h)
        assert found == r
    chained = []
    charged = 0
    for (mid, dpath), d in t._dirs.items():
        assert t._dir_path[d] == dpath and t._dir_mount[d] == mid
        r, prev, n = t._dir_head[d], -1, 0
        while r >= 0:
            assert recs[r][4] >> metatable._FLAG_BITS == d and recs[r][7] == prev
            chained.append(r)
            prev, r, n = r, recs[r][8], n + 1
        assert n == t._dir_count[d] > 0
        charged += metatable.DIR_BYTES + len(dpath)
    assert sorted(chained) == live
    for mid, paths in t._sorted.items():
        assert paths == sorted(p for (m, p) in t._dirs if m == mid)
    charged += sum(metatable.ENTRY_BYTES + recs[r][2] + recs[r][3] for r in live)
    assert t._charged == charged


KEYS = ["a", "b/c", "data/x.bin", "ünïcødé/ключ/鍵", "emoji/🙂.jpg", "", "a" * 300, "k\ud800x"]
MOUNTS = ["m1", "m2"]
VERSIONS = ["0123456789abcdef0123456789abcdef", "0123456789ABCDEF0123456789ABCDEF",
            "0123456789abcdef0123456789abcdef-12", "", "v", "x" * 40, "vérsion-ü", "sur\udc80r"]

paths = st.builds(CachePath, st.sampled_from(MOUNTS), st.sampled_from(KEYS))
metas = st.tuples(st.integers(0, 2**62), st.sampled_from(VERSIONS + [None]), st.sampled_from([0.0, 1.5, 1.7e9, -3.25]),
                  st.booleans())
ops = st.one_of(
    st.tuples(st.just("put"), paths, metas),
    st.tuples(st.just("get"), paths),
    st.tuples(st.just("pop"), paths),
    st.tuples(st.just("pop_where"), st.sampled_from(MOUNTS), st.sampled_from(["", "a", "d", "ü", "zz"])),
    st.tuples(st.just("tick"), st.sampled_from([0.0, 1.0, 4.0, 9.999, 10.0, 25.0])),
)


def make_meta(path: CachePath, spec: tuple) -> ObjectMeta:
    size, version, mtime, is_dir = spec
    if version is None:  # what local stores get: size + mtime
        version = f"{size}-{mtime!r}"
    return ObjectMeta(path, size, version, mtime, is_dir)


def run_against_model(ops_list: list, max_entries: int, ttl: float = 10.0) -> MetadataTable:
    clock = Clock()
    table = MetadataTable(ttl, max_entries=max_entries, clock=clock)
    model: TTLCache[CachePath, ObjectMeta] = TTLCache(ttl, max_entries=max_entries, clock=clock)
    for op in ops_list:
        if op[0] == "put":
            clock.now += 0.001  # eviction is by put time to the millisecond: one put a millisecond
            meta = make_meta(op[1], op[2])
            table.put(op[1], meta)
            model.put(op[1], meta)
        elif op[0] == "get":
            got, want = table.get(op[1]), model.get(op[1])
            assert got == want
            if got is not None:  # exact round trip, types included
                assert repr(got) == repr(want)
        elif op[0] == "pop":
            table.pop(op[1])
            model.pop(op[1])
        elif op[0] == "pop_where":
            mount, prefix = op[1], op[2]
            pred = lambda p, m=mount, pre=prefix: p.mount == m and p.key.startswith(pre)  # noqa: E731
            table.pop_prefix(mount, prefix)
            model.pop_where(pred)
        else:
            clock.now += op[1]
        assert len(table) == len(model._data)
    check_invariants(table)
    for mount in MOUNTS:
        for key in KEYS:
            p = CachePath(mount, key)
            assert table.get(p) == model.get(p)
    return table


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, max_size=60), st.integers(1, 6))
def test_matches_ttlcache(ops_list, max_entries):
    run_against_model(ops_list, max_entries)


@settings(max_examples=100, deadline=None)
@given(st.lists(ops, max_size=40))
def test_matches_ttlcache_with_every_hash_colliding(ops_list):
    saved = metatable._hash
    metatable._hash = lambda kb, seed=0: 42
    try:
        run_against_model(ops_list, max_entries=100)
    finally:
        metatable._hash = saved


def test_collisions_never_answer_for_another_key(monkeypatch):
    monkeypatch.setattr(metatable, "_hash", lambda kb, seed=0: 7)
    t = MetadataTable(10, max_entries=1000)
    ps = [CachePath("m", f"k{i}") for i in range(100)]
    for i, p in enumerate(ps[:50]):
        t.put(p, ObjectMeta(p, i, f"{i:032x}", float(i)))
    for i, p in enumerate(ps):
        got = t.get(p)
        assert (got is None) if i >= 50 else (got.size == i and got.path == p)
    assert t.get(CachePath("other", "k1")) is None
    for p in ps[:50:2]:
        t.pop(p)
    for i, p in enumerate(ps[:50]):
        assert (t.get(p) is None) == (i % 2 == 0)
    check_invariants(t)


def test_ttl_and_expiry():
    clock = Clock()
    p = CachePath("m", "k")
    meta = ObjectMeta(p, 1, "v", 2.0)
    t = MetadataTable(10, clock=clock)
    t.put(p, meta)
    clock.now += 9.99
    assert t.get(p) == meta
    clock.now += 0.01
    assert t.get(p) is None and len(t) == 0
    off = MetadataTable(0, clock=clock)
    off.put(p, meta)
    assert off.get(p) is None and len(off) == 0


def test_versions_and_directories_round_trip():
    t = MetadataTable(100)
    cases = [
        ("etag", 5, "d41d8cd98f00b204e9800998ecf8427e", 1.7e9, False),
        ("etag-upper", 5, "D41D8CD98F00B204E9800998ECF8427E", 1.7e9, False),
        ("multipart", 5, "d41d8cd98f00b204e9800998ecf8427e-17", 1.7e9, False),
        ("local", 12345, "12345-1712345678.123456", 1712345678.123456, False),
        ("local-mismatch", 12345, "12345-1712345678.5", 1712345678.123456, False),
        ("dir", 0, "", 1.0, True),
        ("odd", 1, "gen:1712345678901234", 0.0, False),
        ("ключ/🙂", 2**40, "ü" * 33, -1.5, False),
    ]
    for key, size, version, mtime, is_dir in cases:
        p = CachePath("m", key)
        t.put(p, ObjectMeta(p, size, version, mtime, is_dir))
    for key, size, version, mtime, is_dir in cases:
        got = t.get(CachePath("m", key))
        assert (got.size, got.version, got.mtime, got.is_dir) == (size, version, mtime, is_dir)
        assert type(got.version) is str and type(got.is_dir) is bool
    assert t._row(0)[4] & metatable._ETAG and t._row(0)[3] == 16
    assert t._row(3)[4] & metatable._DERIVED and t._row(3)[3] == 0


def test_update_changes_version_length_both_ways():
    t = MetadataTable(100)
    p = CachePath("m", "obj")
    for version in ["short", "a-much-longer-version-string", "d41d8cd98f00b204e9800998ecf8427e", "", "x" * 100,
                    "7-1.0", "mid"]:
        t.put(p, ObjectMeta(p, 7, version, 1.0))
        assert t.get(p).version == version
        check_invariants(t)
    assert len(t) == 1


def test_eviction_order_with_batched_scans_matches_ttlcache():
    """Bounds above 256 scan for several candidates at once; the order must still be TTLCache's."""
    rng = random.Random(5)
    clock = Clock()
    t = MetadataTable(50, max_entries=700, clock=clock)
    model: TTLCache[CachePath, ObjectMeta] = TTLCache(50, max_entries=700, clock=clock)
    keys = [CachePath(rng.choice(MOUNTS), f"dir{i % 7}/" + "k" * rng.randint(1, 30) + str(i)) for i in range(2000)]
    for step in range(20_000):
        p = rng.choice(keys)
        r = rng.random()
        if r < 0.6:
            clock.now += 0.001
            meta = ObjectMeta(p, step, f"{step:032x}" if step % 3 else f"v{step}", float(step))
            t.put(p, meta)
            model.put(p, meta)
        elif r < 0.9:
            assert t.get(p) == model.get(p)
        elif r < 0.99:
            t.pop(p)
            model.pop(p)
        elif r < 0.995:
            for mount in MOUNTS:
                t.pop_prefix(mount, "dir3")
            model.pop_where(lambda q: q.key.startswith("dir3"))
        else:
            clock.now += rng.choice([1.0, 20.0])
        assert len(t) == len(model._data)
    check_invariants(t)
    for p in keys:
        assert t.get(p) == model.get(p)


def test_arena_compaction_keeps_every_entry(monkeypatch):
    monkeypatch.setattr(metatable, "_COMPACT_MIN", 256)
    t = MetadataTable(100, max_entries=10_000)
    rng = random.Random(1)
    want: dict[CachePath, ObjectMeta] = {}
    for i in range(2000):  # long keys, then most of them gone: the arena is mostly garbage
        p = CachePath("m", f"long/{'y' * 100}/{i}")
        want[p] = ObjectMeta(p, i, "w" * 30, 0.0)
        t.put(p, want[p])
    for i in range(0, 2000, 20):
        for j in range(i + 1, i + 20):
            p = CachePath("m", f"long/{'y' * 100}/{j}")
            t.pop(p)
            del want[p]
    before = t._arena_len
    for step in range(5000):
        p = CachePath("m", "x" * rng.randint(0, 60) + str(rng.randint(0, 300)))
        if rng.random() < 0.4 and want:
            victim = rng.choice(list(want))
            t.pop(victim)
            del want[victim]
        meta = ObjectMeta(p, step, "v" * rng.randint(0, 50), float(step))
        t.put(p, meta)
        want[p] = meta
        if step == 0:
            assert t._arena_len < before // 4  # compacted on the first put
    check_invariants(t)
    assert t._arena_len - t._live_bytes <= max(256, t._arena_len // 2)
    for p, meta in want.items():
        assert t.get(p) == meta


def test_pop_prefix_drops_exactly_the_prefix():
    t = MetadataTable(100)
    keys = ("x/1", "x/2", "x/10", "xy/1", "x", "y/ü", "x/a/b", "x/a/c/d", "ü/ü", "ü/üa")
    for mount in ("a", "b"):
        for key in keys:
            p = CachePath(mount, key)
            t.put(p, ObjectMeta(p, 1, "v", 1.0))
    for prefix in ("x/1", "x/a/", "ü/ü", "x", ""):
        assert t.pop_prefix("a", prefix) == sum(1 for k in keys if k.startswith(prefix))
        check_invariants(t)
        assert [k for k in keys if t.get(CachePath("a", k)) is not None] == [k for k in keys if not k.startswith(prefix)]
        assert all(t.get(CachePath("b", k)) is not None for k in keys)
        for key in keys:
            p = CachePath("a", key)
            t.put(p, ObjectMeta(p, 1, "v", 1.0))
    assert t.pop_prefix("nomount", "") == 0


def test_threads_share_one_table():
    t = MetadataTable(100, max_entries=3000)
    errors = []

    def work(seed: int) -> None:
        try:
            for i in range(3000):
                p = CachePath("m", f"t{seed}/k{i % 1000}")
                t.put(p, ObjectMeta(p, i, f"{i:032x}", 1.0))
                got = t.get(p)
                assert got is None or got.path == p
                if i % 7 == 0:
                    t.pop(p)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(t) <= 3000
    check_invariants(t)


def test_memory_per_object_at_100k():
    n = 100_000
    t = MetadataTable(3600, max_entries=n + 1)
    for i in range(1, n + 1):
        p = CachePath("data", f"train/shard-{i // 1000:05d}/sample-{i:09d}.jpg")
        t.put(p, ObjectMeta(p, 100_000 + i, f"{i:032x}", 1.7e9 + i))
    per_object = t.memory_bytes() / n
    assert per_object < 200, per_object
    p = CachePath("data", f"train/shard-00012/sample-{12345:09d}.jpg")
    assert t.get(p) == ObjectMeta(p, 112_345, f"{12345:032x}", 1.7e9 + 12345)


def test_objectstore_uses_it():
    from cachefs.mounts import MountTable
    from cachefs.store.objects import ObjectStore

    store = ObjectStore(MountTable([]), metadata_cache_bytes=5000)
    assert isinstance(store._meta, MetadataTable) and store._meta.max_bytes == 5000


@pytest.mark.parametrize("max_entries", [0, -1])
def test_no_room_means_nothing_kept(max_entries):
    t = MetadataTable(10, max_entries=max_entries)
    p = CachePath("m", "k")
    t.put(p, ObjectMeta(p, 1, "v", 1.0))
    assert t.get(p) is None


def test_bound_is_bytes_and_the_oldest_put_goes_first():
    """Each entry is charged ENTRY_BYTES + its name after the last "/" + its stored version,
    each directory DIR_BYTES + its path; past max_bytes the entries put longest ago go."""
    clock = Clock()
    one = metatable.ENTRY_BYTES + len("k0000") + 16  # an ETag is kept as 16 bytes
    bound = metatable.DIR_BYTES + len("d/") + 100 * one
    t = MetadataTable(1000, max_bytes=bound, clock=clock)
    for i in range(250):
        clock.now += 0.001
        p = CachePath("m", f"d/k{i:04d}")
        t.put(p, ObjectMeta(p, i, f"{i:032x}", 1.0))
        assert t.charged_bytes() <= bound
    assert len(t) == 100
    assert [i for i in range(250) if t.get(CachePath("m", f"d/k{i:04d}")) is not None] == list(range(150, 250))
    # Put again: the refreshed entry is the youngest, so the next one out is the one after it.
    clock.now += 0.001
    p = CachePath("m", "d/k0150")
    t.put(p, ObjectMeta(p, 150, f"{150:032x}", 1.0))
    clock.now += 0.001
    q = CachePath("m", "d/k9999")
    t.put(q, ObjectMeta(q, 1, f"{1:032x}", 1.0))
    assert t.get(p) is not None and t.get(CachePath("m", "d/k0151")) is None
    check_invariants(t)


def test_sizes_past_32_bits_and_expiry_past_49_days():
    clock = Clock()
    t = MetadataTable(10, clock=clock)
    p, q = CachePath("m", "big"), CachePath("m", "small")
    t.put(p, ObjectMeta(p, 5 << 40, "v", 1.0))
    t.put(q, ObjectMeta(q, 0xFFFFFFFE, "v", 1.0))
    assert t.get(p).size == 5 << 40 and t.get(q).size == 0xFFFFFFFE
    t.put(p, ObjectMeta(p, 3, "v", 1.0))  # shrinks: no longer in the side table
    assert t.get(p).size == 3 and not t._big
    for _ in range(3):  # expiries are 32-bit milliseconds: the epoch moves on
        clock.now += 30 * 86400
        assert t.get(p) is None
        t.put(p, ObjectMeta(p, 3, "v", 1.0))
        clock.now += 9.999
        assert t.get(p) is not None
        assert t.get_with_expiry(p)[1] == pytest.approx(clock.now + 0.001, abs=1e-6)
        clock.now += 0.001
        assert t.get(p) is None
    check_invariants(t)


def test_freeing_a_prefix_costs_what_it_frees_and_never_stalls_reads():
    """#47: a Free of 1,000 objects among 1,000,000 returns in milliseconds (a walk of the whole
    table under its lock took ~1.5 s, every read waiting) and a reader meanwhile never waits long."""
    import time

    from cachefs.mounts import MountTable
    from cachefs.store.objects import ObjectStore

    store = ObjectStore(MountTable([]), metadata_ttl=3600)
    table = store._meta
    for i in range(1_000_000):
        p = CachePath("data", f"train/{i // 1000:05d}/{i:08d}.jpg")
        table.put(p, ObjectMeta(p, 4096, f"4096-{1.7e9!r}", 1.7e9))
    probe = CachePath("data", "train/00999/00999999.jpg")
    waits: list[float] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            assert table.get(probe) is not None
            waits.append(time.perf_counter() - t0)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        time.sleep(0.05)
        t0 = time.perf_counter()
        store.forget_prefix("data", "train/00500/")
        took = time.perf_counter() - t0
    finally:
        stop.set()
        reader.join(timeout=10)
    assert took < 0.1, took
    assert max(waits) < 0.1, max(waits)
    assert len(table) == 999_000
    assert table.get(CachePath("data", "train/00500/00500000.jpg")) is None
    assert table.get(CachePath("data", "train/00501/00501000.jpg")) is not None


def test_a_prefix_inside_one_big_directory_is_freed_a_batch_at_a_time():
    """A flat bucket: the prefix ends inside its one directory, whose names are tested in
    batches, the lock let go in between; entries freed meanwhile by others do not lose the place."""
    t = MetadataTable(100)
    for i in range(20_000):
        p = CachePath("m", f"img{i:06d}")
        t.put(p, ObjectMeta(p, i, "v", 1.0))
    real_free = t._free_row
    popped = []

    def free_and_pop_another(slot: int, r: int) -> None:  # another thread's pop, between batches
        real_free(slot, r)
        if not popped:
            victim = CachePath("m", "img019999")
            popped.append(victim)
            t._lock.release()
            try:
                t.pop(victim)
            finally:
                t._lock.acquire()

    t._free_row = free_and_pop_another
    assert t.pop_prefix("m", "img0100") == 100
    t._free_row = real_free
    assert len(t) == 20_000 - 101
    assert t.get(CachePath("m", "img010050")) is None and t.get(CachePath("m", "img011000")) is not None
    check_invariants(t)


def test_a_name_or_version_too_long_to_keep_is_asked_each_time():
    t = MetadataTable(100)
    p = CachePath("m", "d/k")
    t.put(p, ObjectMeta(p, 1, "v1", 1.0))
    t.put(p, ObjectMeta(p, 1, "v" * 70_000, 1.0))  # not kept, and the old version not served
    assert t.get(p) is None
    q = CachePath("m", "d/" + "n" * 70_000)
    t.put(q, ObjectMeta(q, 1, "v", 1.0))
    assert t.get(q) is None and len(t) == 0
    check_invariants(t)
