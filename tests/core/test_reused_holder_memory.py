"""A holder's next version in memory its earlier versions held, cut otherwise.

Found in a full-suite CI run (tests/vllm/test_vllm_fp8.py): after a pull that
failed its integrity check, a TP worker could not read the next, good version
from the other trainer: NIXL ``createXferReq: no specified or potential backend
had the required registrations`` (NIXL_ERR_NOT_FOUND). The integrity failure
was not the cause. A reader keeps a holder's NIXL agent loaded across versions,
and NIXL adds each new replica's metadata to what it holds of that agent and
never drops the descriptors of memory the holder has since unregistered and
freed. NIXL finds the registration covering a READ's range by a binary search
that looks at one neighbour only: a stale descriptor of an earlier version
starting inside the new one's memory hides it, and every READ that starts
past that point fails. The trainer there allocated fresh tensors for each
version; whether its allocator reused the old addresses that way was chance.

Here the holder places its tensors in one buffer of its own (``publish_at``),
so the overlap is certain: version 1 puts a small tensor 64 bytes in and a
large one at 128 KiB; version 3 puts the large one at 0, over the small one's
old place."""

from __future__ import annotations

import pytest

from tensorhub.testing import RemoteError

SPECS = [("a", "float32", (16,)), ("b", "float32", (16384,))]  # 64 B, 64 KiB
CHUNK = 4 << 10  # READs of "b" start inside it, past the stale descriptor
OLD = [64, 128 << 10]  # "a" 64 bytes in, "b" at 128 KiB
NEW = [128 << 10, 0]  # "b" at 0, over the place "a" had


@pytest.mark.parametrize("corrupted_between", [True, False], ids=["after-a-failed-integrity-pull", "alone"])
def test_a_holders_next_version_in_its_reused_memory_is_read_exactly(hubs, corrupted_between):
    good = hubs("good", labels={"host": "far"}, chunk_size=CHUNK)
    reader = hubs("reader", labels={"host": "near"}, chunk_size=CHUNK)
    assert good.call("publish_at", model="m", version=1, specs=SPECS, seed=1, offsets=OLD) == dict(zip("ab", OLD))
    got = reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=1, keep="dest")
    assert got["mismatched"] == [] and got["lost"] == []
    good.call("unpublish", model="m", version=1)
    if corrupted_between:  # the CI run's order: a version from another holder fails its check in between
        bad = hubs("bad", labels={"host": "near"}, chunk_size=CHUNK)
        bad.call("publish", model="m", version=2, specs=SPECS, seed=2)
        bad.call("corrupt", model="m", version=2, tensor="b", byte=5000)
        with pytest.raises(RemoteError) as failed:
            reader.call("pull", model="m", version=2, specs=SPECS, keep="dest", timeout=30)
        assert failed.value.type_name == "IntegrityError"
    assert good.call("publish_at", model="m", version=3, specs=SPECS, seed=3, offsets=NEW) == dict(zip("ab", NEW))
    got = reader.call("pull", model="m", version=3, specs=SPECS, expect_seed=3, keep="dest", timeout=30)
    assert got["mismatched"] == [] and got["lost"] == [], got
    assert got["sources"] == {"good": got["nbytes"]}
