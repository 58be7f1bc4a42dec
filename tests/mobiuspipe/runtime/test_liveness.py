"""The ranks' signs of life: a peer that stops beating is lost after comm_timeout_s, one that beats or ended its run
well is not, a store that stops answering is a loss too; the waits that ask the watch raise its verdict."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mobiuspipe.errors import PeerLostError, PipelineError
from mobiuspipe.runtime.peers import ranks
from mobiuspipe.runtime.peers.comm import Comm, Posted
from mobiuspipe.runtime.peers.liveness import MAX_BEAT_S, Liveness, Waiter, await_work, beat_interval
from mobiuspipe.runtime.peers.ranks import Membership, RankInfo
from mobiuspipe.standin.p2p import StrictWork


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class DictStore:
    """A store of counters; `down` makes every call fail as a store whose host died would."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.down = False

    def add(self, key: str, value: int) -> int:
        if self.down:
            raise RuntimeError("Connection reset by peer\nmore")
        self.counts[key] = self.counts.get(key, 0) + value
        return self.counts[key]


def _watch(store: DictStore, clock: FakeClock, lost_after_s: float = 10.0, rank: int = 0, world: int = 3):
    aborted: list[int] = []
    w = Liveness(rank, world, store, lost_after_s, on_lost=lambda: aborted.append(1), clock=clock)
    return w, aborted


def _looks(w: Liveness, clock: FakeClock, *gaps_s: float) -> None:
    """A look after each gap of the fake clock."""
    for gap in gaps_s:
        clock.now += gap
        w.look()


def test_a_peer_that_stops_beating_is_lost_after_the_timeout():
    store, clock = DictStore(), FakeClock()
    w, aborted = _watch(store, clock)
    for _ in range(5):  # ranks 1 and 2 beat as often as rank 0 looks
        store.add("1", 1)
        store.add("2", 1)
        w.look()
        clock.now += 3.0
    w.check()
    for _ in range(3):  # rank 2 stops; rank 1 goes on
        store.add("1", 1)
        w.look()
        clock.now += 3.0
    assert w.verdict is None  # 9 s of silence: not yet
    store.add("1", 1)
    w.look()
    assert w.verdict is not None and w.verdict.startswith("rank 0: rank 2 has given no sign of life for 12 s")
    assert "runtime.comm_timeout_s is 10" in w.verdict and "rank 1" not in w.verdict
    assert aborted == [1]
    with pytest.raises(PeerLostError, match="rank 2 has given no sign of life"):
        w.check()


def test_a_peer_that_never_beat_is_lost_too():
    store, clock = DictStore(), FakeClock()
    w, _ = _watch(store, clock, world=2)
    _looks(w, clock, 0.0, 10.0)
    assert w.verdict is not None and "rank 1 has given no sign of life for 10 s" in w.verdict


def test_a_peer_that_ended_its_run_is_not_watched():
    store, clock = DictStore(), FakeClock()
    w, aborted = _watch(store, clock, world=2)
    w.look()
    store.add("done1", 1)  # rank 1's Membership.close after a run that went well
    clock.now += 60.0
    w.look()
    assert w.verdict is None and aborted == []


def test_a_store_that_stops_answering_is_a_loss_once_it_has_been_silent_that_long():
    store, clock = DictStore(), FakeClock()
    w, aborted = _watch(store, clock, world=2)
    w.look()
    store.down = True
    _looks(w, clock, 1.0, 5.0)
    store.down = False  # it came back: the count starts again
    store.add("1", 1)
    w.look()
    store.down = True
    _looks(w, clock, 1.0, 9.9)
    assert w.verdict is None
    _looks(w, clock, 0.1)
    assert w.verdict is not None and "the job's store has not answered for 10 s (Connection reset by peer)" in w.verdict
    assert "more" not in w.verdict and aborted == [1]


class StoppedStore:
    """A store whose host is stopped: a call never returns (TCPStore's timeout does not end an add)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def add(self, key: str, value: int) -> int:
        self.release.wait()
        return 0


def test_a_store_whose_host_is_stopped_is_a_loss_and_holds_no_wait():
    store, clock = StoppedStore(), FakeClock()
    w = Liveness(0, 2, store, lost_after_s=0.8, clock=clock)  # a look waits a beat (0.1 s) for the store
    start = time.monotonic()
    w.look()
    clock.now += 0.9
    w.look()
    assert time.monotonic() - start < 2
    assert w.verdict is not None and "the job's store has not answered for 1 s (no answer within 0.1 s)" in w.verdict
    start = time.monotonic()
    w.stop(done=True)  # marking the run done waits lost_after_s at most, then says why it could not
    assert time.monotonic() - start < 2
    store.release.set()


def test_beats_come_several_times_per_timeout_and_at_most_a_few_seconds_apart():
    assert beat_interval(8.0) == pytest.approx(1.0)
    assert beat_interval(3600.0) == MAX_BEAT_S


def test_two_ranks_on_one_store_find_the_one_that_stopped():
    """Threads as a job runs them, on torch's in-memory store: both live, then rank 1 stops without its done mark."""
    store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage]
    ranks = [Liveness(r, 2, store, lost_after_s=0.8) for r in (0, 1)]
    for r in ranks:
        r.start()
    time.sleep(1.6)  # twice the timeout: both beat meanwhile
    assert [r.verdict for r in ranks] == [None, None]
    ranks[1].stop(done=False)
    deadline = time.monotonic() + 10
    while ranks[0].verdict is None and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks[0].stop(done=False)
    assert ranks[0].verdict is not None and "rank 1 has given no sign of life" in ranks[0].verdict


class _Verdict:
    """A watch whose verdict comes after `after_s`."""

    def __init__(self, after_s: float) -> None:
        self.at = time.monotonic() + after_s

    def check(self) -> None:
        if time.monotonic() >= self.at:
            raise PeerLostError("rank 0: rank 1 has given no sign of life for 60 s")


def test_a_watched_receive_waits_past_the_timeout_and_ends_with_the_verdict(monkeypatch):
    monkeypatch.setenv("MOBIUSPIPE_STRICT", "1")
    watch = _Verdict(after_s=0.5)
    comm = Comm(rank=0, timeout_s=0.1, watch=watch)
    work = StrictWork()
    threading.Timer(0.3, work._end).start()  # arrives after the timeout, before any verdict: waited for
    comm.take(Posted(work, torch.zeros(1), "rank 1", "receiving x from rank 1"))
    with pytest.raises(PeerLostError, match="^rank 0: rank 1 has given no sign of life"):
        comm.take(Posted(StrictWork(), torch.zeros(1), "rank 1", "receiving y from rank 1"))


def test_an_error_after_a_verdict_reports_the_verdict(monkeypatch):
    monkeypatch.setenv("MOBIUSPIPE_STRICT", "1")
    comm = Comm(rank=0, timeout_s=5, watch=_Verdict(after_s=0.0))
    work = StrictWork()
    work._end(RuntimeError("Connection closed by peer"))
    with pytest.raises(PeerLostError, match="no sign of life"):
        comm.take(Posted(work, torch.zeros(1), "rank 1", "receiving x from rank 1"))


class _Flips:
    """A request that completes after `n` looks."""

    def __init__(self, n: int) -> None:
        self.looks, self.n = 0, n

    def is_completed(self) -> bool:
        self.looks += 1
        return self.looks > self.n

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


def test_await_work_polls_until_done_or_lost():
    work = _Flips(5)
    await_work(work, _Verdict(after_s=60))
    assert work.looks == 6
    with pytest.raises(PeerLostError):
        await_work(_Flips(10**9), _Verdict(after_s=0.05))


class _GlooWork:
    """A gloo point-to-point request: is_completed() stays False; wait() blocks until it ends (or fails)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.ended, self.error, self.threads = threading.Event(), error, []

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout: timedelta | None = None) -> bool:
        assert timeout is None  # the process group's deadline, not comm_timeout_s
        self.threads.append(threading.current_thread())
        self.ended.wait()
        if self.error is not None:
            raise self.error
        return True


def test_the_waiter_waits_on_its_thread_while_the_watch_is_asked():
    waiter = Waiter()
    works = [_GlooWork() for _ in range(2)]
    for work in works:
        threading.Timer(0.2, work.ended.set).start()  # past any sliced deadline: waited for all the same
        assert waiter.wait(work.wait, _Verdict(after_s=60)) is True
    assert works[0].threads == works[1].threads and works[0].threads[0] is not threading.current_thread()
    assert works[0].threads[0].daemon  # a thread blocked on a lost peer never holds up the process's exit
    failed = _GlooWork(RuntimeError("Connection closed by peer"))
    failed.ended.set()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        waiter.wait(failed.wait, _Verdict(after_s=60))
    waiter.close()


def test_the_waiter_ends_a_wait_with_the_verdict_while_its_thread_stays_blocked():
    waiter, work = Waiter(), _GlooWork()
    t0 = time.monotonic()
    with pytest.raises(PeerLostError, match="no sign of life"):
        waiter.wait(work.wait, _Verdict(after_s=0.2))
    assert time.monotonic() - t0 < 2 and work.threads[0].is_alive()
    waiter.close()
    later = _GlooWork()
    later.ended.set()
    assert waiter.wait(later.wait, _Verdict(after_s=60)) is True  # a new thread: the old one is still blocked
    assert later.threads[0] is not work.threads[0]
    waiter.close()
    work.ended.set()
    work.threads[0].join(5)
    assert not work.threads[0].is_alive()  # once its wait ends, the closed waiter's thread ends


def test_the_waiters_thread_is_bound_before_its_first_job():
    """The warm-up posts on the waiter's thread, where NCCL makes communicators: the thread runs bind (the rank's
    gpu, Device.bind_thread) before any job."""
    bound: list[threading.Thread] = []
    waiter = Waiter(bind=lambda: bound.append(threading.current_thread()))
    work = _GlooWork()
    work.ended.set()
    assert waiter.wait(work.wait, _Verdict(after_s=60)) is True
    assert bound == work.threads and bound[0] is not threading.current_thread()
    waiter.close()


def test_a_watched_lax_receive_waits_past_the_timeout(monkeypatch):
    monkeypatch.setenv("MOBIUSPIPE_STRICT", "0")
    comm = Comm(rank=0, timeout_s=0.05, watch=_Verdict(after_s=60))
    work = _GlooWork()
    threading.Timer(0.3, work.ended.set).start()
    got = comm.take(Posted(work, torch.ones(2), "rank 1", "receiving x from rank 1"))  # type: ignore[arg-type]
    assert got.tolist() == [1.0, 1.0]
    comm.close()


def test_the_timeouts_must_be_ordered():
    with pytest.raises(PipelineError, match="expected 0 < comm_timeout_s <= hang_timeout_s"):
        Membership(RankInfo(0, 1, 0, False), 60.0, 30.0)
    one = Membership(RankInfo(0, 1, 0, False), 60.0, 60.0)
    one.watch()  # a job of one rank has nobody to watch
    assert one.liveness is None
    one.close()


def test_a_lost_peer_aborts_the_group_the_rank_made(monkeypatch):
    """On NCCL the host blocks at a synchronization, not in a wait that asks the watch: the abort ends the kernels that
    wait for the lost peer (abort_group does nothing off NCCL). The rank then leaves the group without its done mark."""
    calls: list[tuple[str, object]] = []
    store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the abort binds the watch's thread to the gpu
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("device", d)))
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # the group's own store, not a client of its own
    monkeypatch.setattr(ranks, "join_group", lambda info, timeout_s: True)
    monkeypatch.setattr(ranks, "_get_default_store", lambda: store)
    monkeypatch.setattr(ranks, "abort_group", lambda owned: calls.append(("abort", owned)))
    monkeypatch.setattr(ranks, "leave_group", lambda owned: calls.append(("leave", owned)))
    group = Membership(RankInfo(1, 2, 1, True), 0.4, 60.0)
    group.watch()  # rank 0 never beats
    assert group.liveness is not None
    deadline = time.monotonic() + 10
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert calls == [("device", 1), ("abort", True)]
    with pytest.raises(PeerLostError, match="rank 0 has given no sign of life"):
        ranks.gather_all(RankInfo(1, 2, 1, True), "anything")  # every wait under the watch raises its verdict
    group.close(failed=True)
    assert calls[2:] == [("leave", True)] and store.add(f"{ranks.BEAT_PREFIX}/done1", 0) == 0


class _Done:
    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


def test_values_reduced_after_a_verdict_are_not_returned(monkeypatch):
    """On NCCL the watch's abort ends a reduction early: its values are whatever the buffer held."""
    monkeypatch.setattr(dist, "all_reduce", lambda t, op, async_op: _Done())
    cpu = torch.device("cpu")
    alive = Comm(rank=0, timeout_s=5, watch=_Verdict(after_s=60))
    assert alive.reduce_values([1.5, 2.0], dist.ReduceOp.SUM, "the loss", cpu) == [1.5, 2.0]
    lost = Comm(rank=0, timeout_s=5, watch=_Verdict(after_s=0))
    with pytest.raises(PeerLostError, match="no sign of life"):
        lost.reduce_values([1.5], dist.ReduceOp.SUM, "the loss", cpu)


def test_a_gather_moves_its_data_a_chunk_at_a_time(monkeypatch):
    """On NCCL gather_all's tensors are on the gpu, beside the arena, counted by no plan: a LoRA export gathered every
    rank's adapters there at once (gigabytes for large ones, world_size times over). It now gathers GATHER_CHUNK bytes
    at a time; the objects come out whole, in rank order, whichever rank's is longer."""
    import pickle

    class Watch:
        def check(self) -> None:
            pass

    g = torch.Generator().manual_seed(5)
    mine, peers = {"a": torch.randn(300, generator=g)}, {"b": torch.randn(37, generator=g), "c": list(range(9))}
    theirs = pickle.dumps(peers)
    sent: list[int] = []

    def all_gather(parts, t, async_op):
        sent.append(t.numel())
        parts[0].copy_(t)
        if len(sent) == 1:
            parts[1].fill_(len(theirs))
        else:
            start = sum(sent[1:-1])
            piece = torch.tensor(list(theirs[start : start + t.numel()]), dtype=torch.uint8)
            parts[1].zero_()
            parts[1][: piece.numel()] = piece
        return _Done()

    monkeypatch.setattr(ranks.liveness, "current", lambda: Watch())
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(ranks, "GATHER_CHUNK", 100, raising=False)
    got = ranks.gather_all(RankInfo(0, 2, 0, False), mine)
    assert torch.equal(got[0]["a"], mine["a"]) and torch.equal(got[1]["b"], peers["b"]) and got[1]["c"] == peers["c"]
    assert sent[0] == 1 and max(sent[1:]) <= 100 and sum(sent[1:]) >= len(pickle.dumps(mine))


def test_the_peers_quiet_since_a_failed_collective_are_named():
    """A killed rank resets its connections at once: a gather fails comm_timeout_s before the watch's verdict. The
    watch waits a few beats and names the peers whose count did not move meanwhile (the one beating is not named)."""
    store = DictStore()
    w = Liveness(0, 3, store, lost_after_s=0.8).start()
    stop = threading.Event()

    def beats():  # rank 2 lives; rank 1 was killed
        while not stop.is_set():
            store.add("2", 1)
            time.sleep(w.beat_s / 2)

    t = threading.Thread(target=beats)
    t.start()
    try:
        time.sleep(3 * w.beat_s)
        assert w.quiet_peers() == [1]
    finally:
        stop.set()
        t.join()
        w.stop(done=True)
    idle = Liveness(0, 3, DictStore(), lost_after_s=0.8)  # never started: it knows nothing of its peers
    assert idle.quiet_peers() == []


_STUCK = """
import sys, time
sys.path.insert(0, {tests!r})
from mobiuspipe.runtime.peers.liveness import Liveness
from test_liveness import DictStore

w = Liveness(0, 2, DictStore(), lost_after_s=0.4, exit_after_s={exit_after!r}).start()
while w.verdict is None:
    time.sleep(0.05)
if {stops!r}:
    w.stop(done=False)
time.sleep(2.0)  # a main thread stuck in a wait the abort did not end, or one that got out and ends in time
print("still running")
"""


@pytest.mark.parametrize("stops", [False, True])
def test_a_rank_stuck_after_its_verdict_ends_its_process_saying_why(stops):
    """A rank of a job's own process whose main thread does not get out of its wait within exit_after_s of the
    verdict (an abort that did not end the gpu's kernels) ends the process with the verdict, exit 2; one that stops
    in time runs on."""
    code = _STUCK.format(tests=str(Path(__file__).parent), exit_after=0.5, stops=stops)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if stops:
        assert proc.returncode == 0 and "still running" in proc.stdout, proc.stderr
    else:
        assert proc.returncode == 2 and "still running" not in proc.stdout
        assert "rank 1 has given no sign of life" in proc.stderr and "did not stop within 0.5 s" in proc.stderr
