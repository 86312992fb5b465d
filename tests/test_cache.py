"""The coherence protocol of `KeyCache`, with message delivery and the clock in the test's hands.

Several `KeyManager`s share one store, each with a cache on a channel of this file (`Bus`): an
in-process transport that keeps the channel contract (a probe reads the store's change log
when it is answered, notices and acknowledgements arrive in order, a registry of readers)
and lets the test decide when each message arrives, lose notices silently, drop a
connection with everything in flight, change the store around apikeys (as `psql` would:
logged, announced to nobody, waiting for nobody), and move the clock. The state machine then
checks the contract's promise: once a change has returned, `verify` never answers with an
older record; once a lease has passed since a change made around apikeys, neither.
The real channels are tested against real servers in `test_cache_servers.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from apikeys import Hasher, KeyManager, MemoryStore
from apikeys.cache import KeyCache
from apikeys.errors import ChangeNotConfirmed, KeyDisabled, KeyExpired, KeyRevoked
from apikeys.stores.contract import Channel, ChannelError, parse_notice
from apikeys.types import ACTIVE, DISABLED, REVOKED, StoredKey, utcnow
from tests.conftest import TEST_PEPPER

LEASE = 1.0


class FakeClock:
    """A clock that moves only when told to; `sleep` waits for it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.now + seconds, future))
        await future

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for entry in list(self._sleepers):
            until, future = entry
            if until <= self.now:
                self._sleepers.remove(entry)
                if not future.done():
                    future.set_result(None)


class Bus:
    """The server side of the test channel: subscribers, the registry, the clock."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.subscribers: dict[str, BusChannel] = {}
        self.registry: dict[str, float] = {}
        # The store's change log (what the triggers write), whoever made the change.
        self.log: list[str] = []


@dataclass
class BusChannel(Channel):
    """A channel whose messages wait in a queue until the test delivers them."""

    bus: Bus
    queue: deque[tuple[str, Any]] = field(default_factory=deque)
    connected: bool = False
    on_notice: Callable[[str], None] | None = None
    last: int = 0

    def __post_init__(self) -> None:
        super().__init__()
        self.native = False

    def __hash__(self) -> int:
        return id(self)

    async def connect(self, ident: str, on_notice: Callable[[str], None]) -> None:
        self.ident = ident
        self.queue.clear()
        self.on_notice = on_notice
        self.last = len(self.bus.log)
        self.connected = True
        self.bus.subscribers[ident] = self

    def drop(self) -> None:
        """The connection breaks: everything in flight to this process is lost."""
        self.connected = False
        for kind, payload in self.queue:
            if kind == "probe" and not payload.done():
                payload.set_exception(ChannelError("dropped"))
        self.queue.clear()

    def deliver(self, count: int) -> None:
        for _ in range(min(count, len(self.queue))):
            kind, payload = self.queue.popleft()
            if kind == "notice":
                assert self.on_notice is not None
                self.on_notice(payload)
            elif kind == "probe":
                if not payload.done():
                    # The probe's read of the log: every change committed until now.
                    assert self.on_notice is not None
                    for notice in self.bus.log[self.last :]:
                        self.on_notice(notice)
                    self.last = len(self.bus.log)
                    payload.set_result(None)
            else:
                notice, reader = payload
                self.acknowledged(notice, reader)

    def lose_notices(self) -> None:
        """Notices in flight to this process vanish, the connection stays (a pooler)."""
        self.queue = deque(item for item in self.queue if item[0] != "notice")

    def _push(self, ident: str, message: tuple[str, Any]) -> None:
        target = self.bus.subscribers.get(ident)
        if target is not None and target.connected:
            target.queue.append(message)

    async def probe(self) -> None:
        if not self.connected:
            raise ChannelError("not connected")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.queue.append(("probe", future))
        await future

    async def register(self, ttl: float) -> None:
        if not self.connected:
            raise ChannelError("not connected")
        self.bus.registry[self.ident] = self.bus.clock.now + ttl

    async def readers(self) -> set[str]:
        now = self.bus.clock.now
        return {ident for ident, until in self.bus.registry.items() if until > now}

    async def ack(self, notice: str) -> None:
        writer, _ = parse_notice(notice)
        self._push(writer, ("ack", (notice, self.ident)))

    async def publish(self, notice: str) -> None:
        for ident in list(self.bus.subscribers):
            self._push(ident, ("notice", notice))


def _version(stored: StoredKey) -> tuple[str, Any]:
    return stored.record.state, stored.record.expires_at


class CacheMachine(RuleBasedStateMachine):
    """Managers sharing a store; changes, deliveries, drops, probes and time in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.runner = asyncio.Runner()
        self.loop = self.runner.get_loop()
        self.clock = FakeClock()
        self.bus = Bus(self.clock)
        self.store = MemoryStore()
        self.managers: list[KeyManager] = []
        self.channels: list[BusChannel] = []
        self.tokens: dict[str, str] = {}
        # key id -> every version the store has held, and the index of the newest version
        # that a completed change guarantees.
        self.history: dict[str, list[tuple[str, Any]]] = {}
        self.floor: dict[str, int] = {}
        # Changes made around apikeys: (key id, version index, when it committed).
        self.by_hand: list[tuple[str, int, float]] = []
        self.tasks: list[asyncio.Task[Any]] = []

    def run(self, awaitable: Awaitable[Any]) -> Any:
        return self.runner.run(_wrap(awaitable))

    def settle(self) -> None:
        """Let every task run until it waits for a message or the clock."""
        self.run(asyncio.sleep(0))
        self.run(asyncio.sleep(0))
        self.tasks = [task for task in self.tasks if not task.done()]

    @initialize(count=st.integers(2, 3), keys=st.integers(1, 2))
    def setup(self, count: int, keys: int) -> None:
        hasher = Hasher(pepper=TEST_PEPPER)
        for _ in range(count):
            channel = BusChannel(self.bus)
            manager = KeyManager(self.store, hasher=hasher, cache=False)
            manager.cache = KeyCache(
                self.store,
                channel,
                lease=LEASE,
                clock=self.clock,
                sleep=self.clock.sleep,
                autostart=False,
            )
            self.managers.append(manager)
            self.channels.append(channel)
            self.run(manager.cache.connect())
        for index in range(keys):
            created = self.run(
                self.managers[0].create(name=f"k{index}", full_access=True, expires_in=None)
            )
            key_id = created.record.id
            self.tokens[key_id] = created.key
            self.history[key_id] = [(ACTIVE, None)]
            self.floor[key_id] = 0

    def teardown(self) -> None:
        try:
            for manager in self.managers:
                self.run(manager.aclose())
        finally:
            for task in self.tasks:
                task.cancel()
            self.runner.close()

    def _cache(self, index: int) -> KeyCache:
        cache = self.managers[index].cache
        assert cache is not None
        return cache

    # -- what processes do ---------------------------------------------------------------

    @rule(data=st.data())
    def change(self, data: st.DataObject) -> None:
        writer = data.draw(st.integers(0, len(self.managers) - 1), label="writer")
        key_id = data.draw(st.sampled_from(sorted(self.tokens)), label="key")
        action = data.draw(st.sampled_from(["revoke", "disable", "enable", "expire"]))
        manager = self.managers[writer]
        versions = self.history[key_id]

        async def apply_and_record(notice: str | None) -> Any:
            if action == "expire":
                await self.store.shorten_expiry(key_id, utcnow() - timedelta(days=1))
            else:
                target = {"revoke": REVOKED, "disable": DISABLED, "enable": ACTIVE}[action]
                sources = {
                    "revoke": (ACTIVE, DISABLED),
                    "disable": (ACTIVE,),
                    "enable": (DISABLED,),
                }[action]
                await self.store.set_state(key_id, target, allowed_from=sources, at=utcnow())
            stored = await self.store.get(key_id)
            assert stored is not None
            versions.append(_version(stored))
            self.bus.log.append(f"store:{len(self.bus.log) + 1}:{key_id}")
            return len(versions) - 1

        async def change_and_complete() -> None:
            cache = manager.cache
            assert cache is not None
            index = await cache.change(key_id, apply_and_record)
            # The change has returned: from now on nothing older may be served.
            self.floor[key_id] = max(self.floor[key_id], index)

        self.tasks.append(self.loop.create_task(change_and_complete()))
        self.settle()

    @rule(data=st.data())
    def change_by_hand(self, data: st.DataObject) -> None:
        """`UPDATE … SET state = …` in psql: logged by the store, announced to nobody."""
        key_id = data.draw(st.sampled_from(sorted(self.tokens)), label="key")
        target = data.draw(st.sampled_from([REVOKED, DISABLED, ACTIVE]), label="state")
        versions = self.history[key_id]

        async def write() -> None:
            await self.store.set_state(
                key_id, target, allowed_from=(ACTIVE, DISABLED, REVOKED), at=utcnow()
            )
            stored = await self.store.get(key_id)
            assert stored is not None
            versions.append(_version(stored))
            self.bus.log.append(f"store:{len(self.bus.log) + 1}:{key_id}")
            self.by_hand.append((key_id, len(versions) - 1, self.clock.now))

        self.run(write())
        self.settle()

    @rule(data=st.data())
    def lose_notices(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.channels) - 1), label="process")
        self.channels[index].lose_notices()
        self.settle()

    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.channels) - 1), label="to")
        count = data.draw(st.integers(1, 4), label="count")

        async def deliver() -> None:
            self.channels[index].deliver(count)

        self.run(deliver())
        self.settle()

    @rule(data=st.data())
    def probe(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.managers) - 1), label="process")
        cache = self._cache(index)

        async def round_or_lost() -> None:
            try:
                await cache.refresh()
            except ChannelError:
                cache.lost()

        self.tasks.append(self.loop.create_task(round_or_lost()))
        self.settle()

    @rule(data=st.data())
    def drop_connection(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.channels) - 1), label="process")
        self.channels[index].drop()
        self.settle()

    @precondition(lambda self: any(not channel.connected for channel in self.channels))
    @rule(data=st.data())
    def reconnect(self, data: st.DataObject) -> None:
        down = [i for i, channel in enumerate(self.channels) if not channel.connected]
        index = data.draw(st.sampled_from(down), label="process")
        self.run(self._cache(index).connect())
        self.settle()

    @rule(seconds=st.sampled_from([0.01, 0.1, 0.3, 0.6, 1.1]))
    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.settle()

    @rule(data=st.data())
    def verify(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.managers) - 1), label="process")
        key_id = data.draw(st.sampled_from(sorted(self.tokens)), label="key")
        manager = self.managers[index]
        cache = self._cache(index)
        stored = cache.get(key_id) or self.run(cache.load(key_id))
        assert stored is not None
        served = _version(stored)
        floor = self.floor[key_id]
        for changed, version, at in self.by_hand:
            # Nobody waited for it: it holds once every proof older than it has run out.
            if changed == key_id and at + LEASE <= self.clock.now:
                floor = max(floor, version)
        allowed = self.history[key_id][floor:]
        assert served in allowed, (
            f"process {index} served {served} for {key_id}; since the last completed change the "
            f"store held only {allowed}"
        )
        # And through the manager: the answer matches the record served.
        with contextlib.suppress(KeyRevoked, KeyDisabled, KeyExpired):
            self.run(manager.verify(self.tokens[key_id], record_usage=False))

    @invariant()
    def bounded(self) -> None:
        for index in range(len(self.managers)):
            assert len(self._cache(index)) <= self._cache(index).max_entries


async def _wrap(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


CacheMachine.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheAgainstTheStore = CacheMachine.TestCase


# --- plain tests of the cache -------------------------------------------------------------


def _stored(key_id: str) -> StoredKey:
    from tests.stores.test_store_conformance import make_key

    return make_key(key_id)


async def test_if_a_million_keys_are_loaded_then_the_cache_keeps_only_its_bound() -> None:
    store = MemoryStore()
    cache = KeyCache(store, BusChannel(Bus(FakeClock())), max_entries=10_000, autostart=False)
    template = _stored("template0000")
    for number in range(1_000_000):
        key_id = f"{number:012d}"
        store._keys[key_id] = template  # the store's own dict: a million inserts, quickly
        await cache.load(key_id)
    assert len(cache) == 10_000
    # Least recently used went first: the last ten thousand are the ones kept.
    assert next(iter(cache._entries)) == f"{990_000:012d}"


async def test_if_cached_then_no_secret_is_held() -> None:
    store = MemoryStore()
    clock = FakeClock()
    channel = BusChannel(Bus(clock))
    manager = KeyManager(store, hasher=Hasher(pepper=TEST_PEPPER), cache=False)
    manager.cache = KeyCache(store, channel, clock=clock, autostart=False)
    await manager.cache.connect()
    created = await manager.create(name="secret", full_access=True)
    await manager.verify(created.key)
    secret = created.key.rsplit("_", 1)[1][:32]
    held = [repr(entry) for entry in manager.cache._entries.values()]
    held += [entry.secret_hash for entry in manager.cache._entries.values()]
    assert held
    assert not any(secret in text for text in held)
    assert secret not in repr(manager.cache)
    await manager.aclose()


async def test_if_not_proven_fresh_then_the_store_is_read() -> None:
    store = MemoryStore()
    clock = FakeClock()
    channel = BusChannel(Bus(clock))
    cache = KeyCache(store, channel, clock=clock, sleep=clock.sleep, autostart=False)
    await cache.connect()
    await store.insert(_stored("aaaaaaaaaaaa"))
    await cache.load("aaaaaaaaaaaa")
    assert cache.get("aaaaaaaaaaaa") is None  # never proven: no answer from the cache
    cache._serving = True
    round_ = asyncio.ensure_future(cache.refresh())
    await asyncio.sleep(0)
    channel.deliver(1)
    await round_
    # Loaded while connected: every notice since has been applied, so the proof covers it.
    assert cache.get("aaaaaaaaaaaa") is not None
    clock.advance(LEASE)
    assert cache.get("aaaaaaaaaaaa") is None  # the proof ran out


async def test_if_a_read_races_with_a_notice_then_it_is_not_kept() -> None:
    store = MemoryStore()
    await store.insert(_stored("bbbbbbbbbbbb"))
    clock = FakeClock()
    channel = BusChannel(Bus(clock))
    cache = KeyCache(store, channel, clock=clock, autostart=False)
    await cache.connect()
    reading = asyncio.Event()
    original = store.get

    async def slow_get(key_id: str) -> StoredKey | None:
        result = await original(key_id)
        await reading.wait()
        return result

    store.get = slow_get  # type: ignore[method-assign]
    load = asyncio.ensure_future(cache.load("bbbbbbbbbbbb"))
    await asyncio.sleep(0)
    cache.on_notice("writer:1:bbbbbbbbbbbb")
    reading.set()
    assert await load is not None  # answered
    assert len(cache) == 0  # but not kept


@pytest.mark.parametrize("lease", [0, -1])
def test_if_lease_not_positive_then_refused(lease: float) -> None:
    with pytest.raises(ValueError, match="lease"):
        KeyCache(MemoryStore(), BusChannel(Bus(FakeClock())), lease=lease)


def test_if_memory_store_then_no_cache() -> None:
    assert KeyManager(MemoryStore()).cache is None
    assert KeyManager("sqlite:///:memory:").cache is None


async def _probe_round(cache: KeyCache, channel: BusChannel) -> None:
    round_ = asyncio.ensure_future(cache.refresh())
    for _ in range(5):
        await asyncio.sleep(0)
    channel.deliver(10)
    await round_


@pytest.mark.parametrize("by_hand", [False, True], ids=["lost-notice", "by-hand"])
async def test_if_a_change_is_never_announced_then_the_next_probe_still_drops_the_key(
    by_hand: bool,
) -> None:
    store = MemoryStore()
    await store.insert(_stored("cccccccccccc"))
    clock = FakeClock()
    bus = Bus(clock)
    channel = BusChannel(bus)
    cache = KeyCache(store, channel, clock=clock, sleep=clock.sleep, autostart=False)
    await cache.connect()
    assert cache.get("cccccccccccc") is None  # a reader from now on
    await cache.load("cccccccccccc")
    await _probe_round(cache, channel)
    assert cache.get("cccccccccccc") is not None
    await store.set_state("cccccccccccc", REVOKED, allowed_from=(ACTIVE,), at=utcnow())
    bus.log.append("store:1:cccccccccccc")  # the store's trigger logs it
    if not by_hand:
        await channel.publish("writer:1:cccccccccccc")
        channel.lose_notices()
    await _probe_round(cache, channel)
    assert cache.get("cccccccccccc") is None
    stored = await cache.load("cccccccccccc")
    assert stored is not None
    assert stored.record.state == REVOKED


async def test_if_an_unknown_id_is_asked_again_then_the_store_is_not_read_again() -> None:
    store = MemoryStore()
    clock = FakeClock()
    bus = Bus(clock)
    channel = BusChannel(bus)
    cache = KeyCache(store, channel, clock=clock, sleep=clock.sleep, autostart=False)
    await cache.connect()
    reads: list[str] = []
    original = store.get

    async def counted_get(key_id: str) -> StoredKey | None:
        reads.append(key_id)
        return await original(key_id)

    store.get = counted_get  # type: ignore[method-assign]
    assert cache.get("dddddddddddd") is None
    await _probe_round(cache, channel)
    assert await cache.load("dddddddddddd") is None
    for _ in range(100):
        assert cache.get("dddddddddddd") is None
        assert cache.missing("dddddddddddd")
    assert reads == ["dddddddddddd"]
    # The key is made (the store logs it): the next probe forgets that it was missing.
    await store.insert(_stored("dddddddddddd"))
    bus.log.append("store:1:dddddddddddd")
    await _probe_round(cache, channel)
    assert not cache.missing("dddddddddddd")
    assert await cache.load("dddddddddddd") is not None
    # Without a fresh proof, absence is not trusted either.
    await cache.load("eeeeeeeeeeee")
    assert cache.missing("eeeeeeeeeeee")
    clock.advance(LEASE)
    assert not cache.missing("eeeeeeeeeeee")


async def test_unknown_ids_never_push_real_records_out() -> None:
    store = MemoryStore()
    await store.insert(_stored("ffffffffffff"))
    cache = KeyCache(store, BusChannel(Bus(FakeClock())), max_entries=10, autostart=False)
    await cache.load("ffffffffffff")
    for number in range(1000):
        await cache.load(f"{number:012d}")
    assert "ffffffffffff" in cache._entries
    assert len(cache._missing) == cache.max_missing == 10


async def test_if_a_change_commits_unconfirmed_then_it_is_announced_and_dropped_all_the_same() -> (
    None
):
    # A change whose replicas did not confirm it in time was made all the same: readers must
    # hear of it and this process must stop serving the old record, before the error is raised.
    store = MemoryStore()
    await store.insert(_stored("dddddddddddd"))
    clock = FakeClock()
    channel = BusChannel(Bus(clock))
    cache = KeyCache(store, channel, clock=clock, sleep=clock.sleep, autostart=False)
    await cache.connect()
    assert cache.get("dddddddddddd") is None  # a reader from now on
    await cache.load("dddddddddddd")
    await _probe_round(cache, channel)
    assert cache.get("dddddddddddd") is not None
    published: list[str] = []
    original = channel.publish

    async def publish(notice: str) -> None:
        published.append(notice)
        await original(notice)

    channel.publish = publish  # type: ignore[method-assign]

    async def revoke_unconfirmed(notice: str | None) -> None:
        await store.set_state("dddddddddddd", REVOKED, allowed_from=(ACTIVE,), at=utcnow())
        raise ChangeNotConfirmed(1, 0, 0.5)

    with pytest.raises(ChangeNotConfirmed):
        await cache.change("dddddddddddd", revoke_unconfirmed, wait=False)
    assert published
    assert published[0].endswith(":dddddddddddd")
    assert cache.get("dddddddddddd") is None
