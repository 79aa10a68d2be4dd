"""AdapterVersions' round trips to the workers, with a stand-in for the
engine that records each ``collective_rpc``: one per update (the retired
versions no use holds go with the next load), and none more on a failed one
than it needs to leave every worker as it was."""

from __future__ import annotations

import pytest


class RecordingEngine:
    """``collective_rpc`` recorded; ``fail``: versions whose load raises, as
    vLLM raises a worker's error (after the worker's drops ran)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.fail: set[int] = set()

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self.calls.append((method, args))
        if method == "tensorhub_adapters_load" and args[1] in self.fail:
            raise RuntimeError(f"Worker failed with error 'version {args[1]}'")
        return [None, None]

    def take(self) -> list[tuple[str, tuple]]:
        calls, self.calls = self.calls, []
        return calls


@pytest.fixture
def versions(hub_server):
    from tensorhub_vllm.adapter_versions import AdapterVersions

    engine = RecordingEngine()
    adapters = AdapterVersions(engine, hub=hub_server.address, model="m/lora")
    engine.take()  # the init
    yield engine, adapters
    adapters._hub.close()


def test_one_round_trip_per_update_the_unused_retired_version_going_with_the_next(versions):
    engine, adapters = versions
    adapters.load(1)
    adapters.load(2)
    assert engine.take() == [("tensorhub_adapters_load", ("m/lora", 1, [])),
                             ("tensorhub_adapters_load", ("m/lora", 2, []))]
    assert adapters.resident() == [1, 2] and adapters.current == 2  # v1 retired, dropped by the next load
    adapters.load(3)
    assert engine.take() == [("tensorhub_adapters_load", ("m/lora", 3, [1]))]
    assert adapters.resident() == [2, 3]
    with pytest.raises(LookupError):
        adapters.request(1)


def test_a_version_in_use_is_not_dropped_by_a_load_but_when_its_use_ends(versions):
    engine, adapters = versions
    adapters.load(1)
    with adapters.use() as lora:
        assert lora.lora_name == "m/lora@1"
        adapters.load(2)
        adapters.load(3)  # v1 is in use: not with this load
        assert engine.take()[-1] == ("tensorhub_adapters_load", ("m/lora", 3, []))
        assert adapters.resident() == [1, 2, 3]
    # v1's last use ended: it goes now, and the unused retired v2 in the same RPC
    assert engine.take() == [("tensorhub_adapters_drop", ("m/lora", [1, 2]))]
    assert adapters.resident() == [3]
    adapters.load(4)
    assert engine.take() == [("tensorhub_adapters_load", ("m/lora", 4, []))]
    assert adapters.resident() == [3, 4]


def test_a_failed_load_keeps_the_current_version_and_drops_what_it_carried(versions):
    engine, adapters = versions
    adapters.load(1)
    adapters.load(2)
    engine.take()
    engine.fail.add(3)
    with pytest.raises(RuntimeError, match="version 3"):
        adapters.load(3)
    # v3 out of every worker that did load it; v1 out of any the RPC did not reach
    assert engine.take() == [("tensorhub_adapters_load", ("m/lora", 3, [1])),
                             ("tensorhub_adapters_drop", ("m/lora", [1, 3]))]
    assert adapters.current == 2 and adapters.resident() == [2]
    engine.fail.clear()
    adapters.load(3)
    assert engine.take() == [("tensorhub_adapters_load", ("m/lora", 3, []))]
    assert adapters.resident() == [2, 3]


class AsyncRecordingEngine(RecordingEngine):
    """The same, as vLLM's async engine (OpenRLHF's actors): ``collective_rpc`` awaited."""

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:  # type: ignore[override]
        return RecordingEngine.collective_rpc(self, method, args)


def test_the_async_front_end_keeps_the_same_books(hub_server):
    """``AsyncAdapterVersions`` (vLLM's AsyncLLM): one round trip per update, a
    version in use kept until its use ends, a failed load undone, as above."""
    import asyncio

    from tensorhub_vllm.adapter_versions import AsyncAdapterVersions

    async def steps(engine: AsyncRecordingEngine) -> None:
        adapters = await AsyncAdapterVersions.start(engine, hub=hub_server.address, model="m/lora")
        try:
            assert engine.take() == [("tensorhub_adapters_init", ({"hub": hub_server.address, "hub_config": {}},))]
            await adapters.load(1)
            async with adapters.use() as lora:
                assert lora.lora_name == "m/lora@1"
                await adapters.load(2)
                await adapters.load(3)
                assert adapters.resident() == [1, 2, 3]
            assert engine.take()[-1] == ("tensorhub_adapters_drop", ("m/lora", [1, 2]))
            engine.fail.add(4)
            with pytest.raises(RuntimeError, match="version 4"):
                await adapters.load(4)
            assert engine.take() == [("tensorhub_adapters_load", ("m/lora", 4, [])),
                                     ("tensorhub_adapters_drop", ("m/lora", [4]))]
            assert adapters.current == 3 and adapters.resident() == [3]
        finally:
            await adapters.close()

    asyncio.run(steps(AsyncRecordingEngine()))
