"""Never hang: a failure on one rank reaches every rank, waits are bounded, ranks agree before they exchange.

The rendezvous store every rank of a process group already shares (the TCPStore of ``torchrun`` or of
``init_process_group``) is the side channel; it still answers when the ring's own traffic cannot.

- `post_failure`: a rank whose ring call, boundary collective or compile raises writes
  ``rank r: <error>`` under ``ringpass/failed/<r>`` before the error leaves ringpass.
- `wait_works`: every wait of the ring and of the boundary collectives (gloo, CPU tensors) runs in a
  helper thread while this rank watches the store. It raises `PeerFailure`, naming the rank and the
  cause, as soon as a peer posted a failure, the connection to a peer broke (its process died), a peer's
  heartbeat stopped for ``dead_after`` seconds (killed or frozen), or the wait outlived ``timeout``
  seconds while every peer was alive and waiting inside ringpass too (a deadlock: the ranks are out of
  step). A peer that is compiling, or busy in the user's code between calls, is waited for (up to the
  process group's own timeout): a long checkpoint save on one rank is not a failure. CUDA tensors (NCCL) are
  waited as NCCL waits (the CPU does not block); NCCL's own watchdog and the process group's ``timeout`` bound those.
- `agree`: every rank posts a fingerprint of its next call and reads every peer's; a difference raises
  the same `InvalidInputError` on every rank, naming the field and the ranks. `agree_once` agrees on a
  fingerprint the first time a rank posts it, and remembers it (calls by hand, `lowering.ring_attention`).
- `meet`: the ranks meet at one line of the user's code before a collective that user code runs (the implicit
  gather of a `SequenceSharded` value): a rank that runs the line alone (logging on rank 0) learns so within
  seconds and withdraws, and the peers never notice.
- A daemon thread per process beats ``ringpass/alive/<r>`` every ``BEAT`` seconds with what the rank is
  doing (`set_state`) and how many ring calls it has begun, so a waiting rank can tell a dead peer from a
  busy one, and a peer that went on from one that is still to come.

A failure is tagged with the call it happened in (`begin_call` numbers the compiled graphs' calls on
each rank); a rank ignores peers' failures from earlier calls and from a call it failed in itself, so
ranks that all refused the same graph can go on. After a `PeerFailure` the process group is not usable:
destroy it (or let the launcher restart the job).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from lowering import compat
from lowering.errors import InvalidInputError, RingpassError
from lowering.groups import resolve_group

PREFIX = "ringpass/"
BEAT = 0.5  # seconds between heartbeats
POLL = 0.1  # seconds between looks at the store while a wait lasts
DEFAULT_TIMEOUT = 30.0
DEFAULT_DEAD_AFTER = 10.0
INSIDE = "inside ringpass"  # how the state of a rank that runs a ring call (or waits in one) begins


class PeerFailure(RingpassError, RuntimeError):
    """Another rank failed, died or is out of step with this one; this rank cannot go on."""


@dataclass
class _Process:
    """This process's place in the job: its call counter, the call it last failed in, its state."""

    call: int = 0
    failed_call: int = -1
    state: str = "starting"
    seen_failures: int = 0
    heartbeat: threading.Thread | None = None
    stop_beating: threading.Event = field(default_factory=threading.Event)
    waiter: ThreadPoolExecutor | None = None
    agreed: set = field(default_factory=set)  # what `agree_once` agreed on: (store, group name, topic, fingerprint)
    meetings: dict = field(default_factory=dict)  # (store, group name, topic) -> meetings held
    settings: dict = field(default_factory=dict)  # group name -> (timeout, dead_after)


_process = _Process()


def configure(group_name: str = "", *, timeout: float | None = None, dead_after: float | None = None) -> None:
    """How long a wait on ``group_name`` ('' = every group) may last while every peer waits inside
    ringpass too (``timeout``), and how long a silent heartbeat means a dead peer (``dead_after``), in
    seconds; a setting not given keeps its value."""
    old = _process.settings.get(group_name, _process.settings.get("", (DEFAULT_TIMEOUT, DEFAULT_DEAD_AFTER)))
    new = (old[0] if timeout is None else timeout, old[1] if dead_after is None else dead_after)
    for name, value in zip(("timeout", "dead_after"), new):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise InvalidInputError(f"{name} must be a positive number of seconds, got {value!r}.")
    _process.settings[group_name] = (float(new[0]), float(new[1]))


def begin_call() -> int:
    """Number the next call of a compiled ring graph on this rank (every rank counts the same calls)."""
    _process.call += 1
    return _process.call


def current_call() -> int:
    return _process.call


def set_state(state: str) -> None:
    """What this rank is doing, as its heartbeat tells the peers (``compiling graph 2``; a state that
    begins with `INSIDE` says the rank runs a ring call)."""
    _process.state = state


class _Channel:
    """The store, this rank and its peers (global ranks) in one process group."""

    def __init__(self, group_name: str):
        group = resolve_group(group_name or None)  # "": the default group
        self.group_name = group_name
        self.store = _tcp_store(compat.get_default_store())
        self.rank = dist.get_rank()
        self.members = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
        self.peers = [r for r in self.members if r != self.rank]
        self.timeout, self.dead_after = _process.settings.get(
            group_name, _process.settings.get("", (DEFAULT_TIMEOUT, DEFAULT_DEAD_AFTER))
        )
        self._beats: dict[int, tuple[int, float]] = {}
        self._looked_at_beats = 0.0
        _start_heartbeat(self.store, self.rank)

    # ---- failures ------------------------------------------------------------------------------------
    def post(self, message: str, *, origin: bool, call: int) -> None:
        _process.failed_call = max(_process.failed_call, call)
        try:
            self.store.set(
                f"{PREFIX}failed/{self.rank}", json.dumps({"call": call, "origin": origin, "message": message})
            )
            self.store.add(f"{PREFIX}failures", 1)
        except Exception:  # the store's host is gone too; the peers find out by themselves
            pass

    def posted(self, force: bool = False) -> list[dict]:
        """Peers' failures that concern this rank's current call, origins first."""
        count = self.store.add(f"{PREFIX}failures", 0)
        if count == _process.seen_failures and not force:
            return []
        _process.seen_failures = count
        found = []
        for peer in self.peers:
            key = f"{PREFIX}failed/{peer}"
            if self.store.check([key]):
                record = json.loads(self.store.get(key))
                if record["call"] >= _process.call and record["call"] > _process.failed_call:
                    found.append({**record, "rank": peer})
        return sorted(found, key=lambda r: (not r["origin"], r["rank"]))

    # ---- liveness ------------------------------------------------------------------------------------
    def look(self, what: str, started: float) -> None:
        """Raise `PeerFailure` if a peer failed, died, or the wait for ``what`` outlived the timeout (the
        failures are read every look, the heartbeats every `BEAT`, the peers' states only at the timeout)."""
        try:
            self._look(what, started)
        except (RuntimeError, OSError) as error:
            if isinstance(error, RingpassError):
                raise
            raise self.failure(
                f"the rendezvous store stopped answering: its host (the launcher's agent under torchrun, "
                f"else rank 0's process) has exited or died: {str(error).splitlines()[0][:200]}",
                what,
            ) from None

    def _look(self, what: str, started: float) -> None:
        failures = self.posted()
        if failures:
            raise self.relayed(failures[0], what)
        now = time.monotonic()
        if now - self._looked_at_beats >= BEAT:
            self._looked_at_beats = now
            for peer in self.peers:
                count = int(self.store.add(f"{PREFIX}alive/{peer}", 0))
                last_count, since = self._beats.get(peer, (-1, now))
                if count != last_count:
                    self._beats[peer] = (count, now)
                elif now - since > self.dead_after:
                    raise self.failure(
                        f"rank {peer} stopped responding (no heartbeat for {now - since:.0f} s: the "
                        "process was killed, or is frozen)",
                        what,
                    )
        if now - started > self.timeout:
            states = {peer: self._state(peer) for peer in self.peers}
            if all(s.startswith(INSIDE) for s in states.values()):
                told = "; ".join(f"rank {p}: {s}" for p, s in states.items())
                raise self.failure(
                    f"waited {now - started:.0f} s (timeout={self.timeout:g}) while every peer is alive and waiting "
                    f"inside ringpass too: the ranks are out of step (different graphs, or a different number of ring "
                    f"calls). The peers say: {told}",
                    what,
                )

    def _state(self, peer: int) -> str:
        key = f"{PREFIX}state/{peer}"
        return self.store.get(key).decode() if self.store.check([key]) else "unknown"

    def calls_begun(self, peer: int) -> int:
        """How many ring calls ``peer`` has begun, as its last heartbeat said (never more than it has)."""
        key = f"{PREFIX}call/{peer}"
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def relayed(self, record: dict, what: str) -> PeerFailure:
        """The `PeerFailure` that passes on a peer's posted failure."""
        return self.failure(f"rank {record['rank']} failed: {record['message']}", what)

    def failure(self, cause: str, what: str) -> PeerFailure:
        message = f"rank {self.rank} stopped while {what}: {cause}"
        self.post(message, origin=False, call=_process.call)
        return PeerFailure(message)

    def dead_peers(self, sample: float) -> list[int]:
        """Peers whose heartbeat did not move during ``sample`` seconds."""
        try:
            before = {p: self.store.add(f"{PREFIX}alive/{p}", 0) for p in self.peers}
            time.sleep(sample)
            return [p for p in self.peers if self.store.add(f"{PREFIX}alive/{p}", 0) == before[p]]
        except Exception:
            return [self.members[0]]  # the store's host (rank 0 of the job) is gone


_channels: dict[tuple, _Channel] = {}


def channel(group_name: str) -> _Channel:
    key = (group_name, id(compat.get_default_store()), _process.settings.get(group_name), _process.settings.get(""))
    if key not in _channels:
        _channels[key] = _Channel(group_name)
    return _channels[key]


def post_failure(group_name: str, error: BaseException, *, call: int | None = None) -> None:
    """Tell the peers in ``group_name`` that this rank failed with ``error`` (a `PeerFailure` was already told)."""
    if isinstance(error, PeerFailure) or not dist.is_initialized():
        return
    text = f"{type(error).__name__}: {error}".strip()
    channel(group_name).post(
        text if len(text) < 2000 else text[:2000] + " ...", origin=True, call=_process.call if call is None else call
    )


@contextmanager
def ring_work(group_name: str):
    """Run the block as ringpass's work: the heartbeat says this rank is inside ringpass meanwhile, and an
    error the block raises is posted to the peers in ``group_name`` ('' = no group) first."""
    state = _process.state
    if not state.startswith(INSIDE):
        set_state(f"{INSIDE}: a ring call after call {_process.call}")
    if group_name:  # this rank's heartbeat beats from its first ring call on: a peer waiting on it sees it alive
        channel(group_name)
    try:
        yield
    except Exception as error:
        if group_name:
            post_failure(group_name, error)
        raise
    finally:
        set_state(state)


def wait_works(works: Sequence, group_name: str, what: str, *, peers: Sequence[int] = ()) -> None:
    """Wait for ``works`` (of a CPU process group), bounded as the module docstring says. ``peers`` are
    the global ranks at the other end of each work, when one is (a P2P send or receive)."""
    if not works:
        return
    future = _waiter().submit(_wait_each, works)
    ch, started = None, time.monotonic()
    while True:
        try:
            future.result(timeout=POLL)
            return
        except FutureTimeout:  # a wait longer than POLL: look at the peers between polls
            ch = ch or channel(group_name)
            ch.look(what, started)
        except Exception as error:
            raise connection_lost(group_name, what, error, _peer_of(error, peers)) from None


def wait_collective(work, tensor, group_name: str, what: str) -> None:
    """Wait for a collective's ``work``: bounded on CPU tensors, as NCCL waits on CUDA ones."""
    if tensor.is_cuda or not group_name:
        work.wait()
    else:
        wait_works([work], group_name, what)


def _peer_of(error: Exception, peers: Sequence[int]) -> int | None:
    index = getattr(error, "work_index", None)
    return peers[index] if index is not None and index < len(peers) else None


def _wait_each(works) -> None:
    for i, work in enumerate(works):
        try:
            work.wait()
        except Exception as error:
            error.work_index = i
            raise


def connection_lost(group_name: str, what: str, error: Exception, peer: int | None = None) -> PeerFailure:
    """The `PeerFailure` for a send, receive or collective that raised (gloo: the connection to ``peer``,
    or to some peer, broke), with the failing rank's own message when it posted one."""
    ch = channel(group_name)
    time.sleep(POLL)  # a peer that raised posts before its process exits: give its message a moment
    failures = ch.posted(force=True)
    if failures:
        return ch.relayed(failures[0], what)
    if peer is not None:
        lost = f"rank {peer}"
    else:
        dead = ch.dead_peers(sample=2 * BEAT + POLL)
        lost = f"rank(s) {', '.join(map(str, dead))}" if dead else "a peer"
    return ch.failure(
        f"the connection to {lost} broke (its process died or left the process group): "
        f"{str(error).splitlines()[0][:200]}",
        what,
    )


def agree(group_name: str, topic: str, mine: dict, describe) -> None:
    """Post ``mine`` for this rank's current call and wait until every member has posted theirs. The
    ranks compare digests (one store round trip per poll, whatever the world size); only when they differ
    are the whole fingerprints read, and ``describe(fingerprints in group rank order)`` says what differs,
    raised as `InvalidInputError` on every rank. Bounded like `wait_works`."""
    ch, call = channel(group_name), _process.call
    text = json.dumps(mine, sort_keys=True)
    digest = f"{call}:{hashlib.sha1(text.encode()).hexdigest()}"

    def key(kind, rank):
        return f"{PREFIX}agree/{topic}/{kind}/{rank}/{call % 4}"  # four calls' slots, reused

    started = time.monotonic()
    try:
        ch.store.multi_set([key("digest", ch.rank), key("full", ch.rank)], [digest, text])
    except (RuntimeError, OSError):
        ch.look("posting this rank's fingerprint", started)  # names what broke
        raise
    digests, waiting = {ch.rank: digest}, list(ch.peers)
    while waiting:
        try:
            keys = [key("digest", p) for p in waiting]
            if ch.store.check(keys):
                for peer, value in zip(list(waiting), ch.store.multi_get(keys)):
                    if value.decode().split(":", 1)[0] == str(call):  # not a slot left from four calls ago
                        digests[peer] = value.decode()
                        waiting.remove(peer)
        except (RuntimeError, OSError):
            pass  # the look below names what broke
        if waiting:
            ch.look(f"waiting for every rank to reach call {call} of a ring graph", started)
            time.sleep(0.0005 if time.monotonic() - started < POLL else POLL)
    if len(set(digests.values())) == 1:
        return
    _process.failed_call = max(_process.failed_call, call)  # every rank raises this itself
    everyone = [json.loads(v) for v in ch.store.multi_get([key("full", r) for r in ch.members])]
    raise InvalidInputError(
        describe(everyone)
        or f"The ranks disagree before call {call} of a ring graph "
        f"(fingerprint digests by rank: {[digests[r] for r in ch.members]})."
    )


def agree_once(group_name: str, topic: str, mine: dict, describe) -> None:
    """`agree` on ``mine`` the first time this rank posts it under ``topic`` in ``group_name``; later calls with
    the same ``mine`` cost a set lookup. The agreement is a call of its own (`begin_call`), made inside ringpass."""
    key = (id(compat.get_default_store()), group_name, topic, json.dumps(mine, sort_keys=True))
    if key in _process.agreed:
        return
    state, call = _process.state, begin_call()
    set_state(f"{INSIDE}: agreeing on {topic} (call {call})")
    try:
        agree(group_name, topic, mine, describe)
    finally:
        set_state(state)
    _process.agreed.add(key)


class Unmet(InvalidInputError):
    """`meet` found that not every rank runs this line: ``where`` (global rank -> what it does instead)."""

    def __init__(self, message: str, where: dict[int, str]):
        super().__init__(message)
        self.where = where


def meet(group_name: str, topic: str, site: str) -> None:
    """Return once every member of ``group_name`` has come to ``site`` (the user's line) for its next meeting
    under ``topic``; raise `Unmet` when not every rank will:

    - a peer came to this meeting at another site: the ranks are out of step, each one that sees it raises (this
      rank's post stays, so every rank at the meeting sees it, and each counts the meeting as held);
    - a peer went on to a later ring call than this rank's, or none came within the group's ``timeout`` (a peer
      busy elsewhere, or at a collective of its own): this rank came alone; it withdraws, as if it never came, and
      the peers never notice.

    A peer that failed or died raises `PeerFailure`, as in `wait_works`. Left open: a rank that gives up on the
    timeout at the instant a peer reaches the same site may leave that peer in the collective (the prompt cases,
    a peer at a later call or at another site, have no such window). Meetings are numbered per (group, topic);
    each rank posts in one of four slots, reused (no rank can be four meetings ahead of another)."""
    ch = channel(group_name)
    counter = (id(compat.get_default_store()), group_name, topic)
    number = _process.meetings.get(counter, 0) + 1
    slot = f"{PREFIX}meet/{topic}/{group_name}/{{}}/{number % 4}"
    ch.store.set(slot.format(ch.rank), json.dumps({"number": number, "site": site}))
    state, started = _process.state, time.monotonic()
    set_state(f"{INSIDE}: meeting the peers at {site} ({topic} {number})")

    def elsewhere() -> dict[int, str]:
        """Peers at this meeting at another site; raises `Unmet` when one is; returns those still to come."""
        coming = {}
        for peer in ch.peers:
            key = slot.format(peer)
            post = json.loads(ch.store.get(key)) if ch.store.check([key]) else None
            if post is None or post["number"] != number:
                coming[peer] = ""
            elif post["site"] != site:
                _process.meetings[counter] = number  # every rank at the meeting sees the difference
                raise Unmet(f"rank {peer} is at {post['site']}", {peer: f"at {post['site']}"})
        return coming

    try:
        while coming := elsewhere():
            went = {p: ch.calls_begun(p) for p in coming if ch.calls_begun(p) > _process.call}
            if not went and time.monotonic() - started > ch.timeout:
                went = dict.fromkeys(coming, 0)
            if went:
                coming = elsewhere()  # a last look before leaving: a peer that came meanwhile is met
                if coming:
                    ch.store.delete_key(slot.format(ch.rank))
                    where = {
                        p: f"went on to ring call {went[p]} (this rank has begun {_process.call})"
                        if went.get(p)
                        else f"has not come (in {time.monotonic() - started:.0f} s; it is {ch._state(p)!r})"
                        for p in coming
                    }
                    raise Unmet("; ".join(f"rank {p} {w}" for p, w in where.items()), where)
                break
            ch.look(f"meeting the peers at {site}", time.monotonic())  # failures and dead peers only
            time.sleep(0.0005 if time.monotonic() - started < POLL else POLL)
    finally:
        set_state(state)
    _process.meetings[counter] = number


def ranks_by_value(values: Sequence) -> dict[str, str]:
    """Each distinct value -> the group ranks that hold it, for people ("rank 1", "ranks 0, 2, 3")."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(str(value), []).append(rank)
    return {value: f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for value, r in groups.items()}


def by_rank(values: Sequence) -> str:
    """Each distinct value with the ranks that hold it: "a on ranks 0, 2; b on rank 1"."""
    return "; ".join(f"{value} on {ranks}" for value, ranks in ranks_by_value(values).items())


def _tcp_store(store):
    """The TCPStore under the default store's prefixes (ringpass keys its own names), or the store itself."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _start_heartbeat(store, rank: int) -> None:
    if _process.heartbeat is not None and _process.heartbeat.is_alive():
        return
    _process.heartbeat = threading.Thread(target=_beat, args=(store, rank), name="ringpass-heartbeat", daemon=True)
    _process.heartbeat.start()
    atexit.register(_stop_heartbeat)


def _stop_heartbeat() -> None:
    """At interpreter exit: let the heartbeat finish its store call and end, before the interpreter tears
    down under it (a daemon thread caught inside a TCPStore call at exit can abort the process)."""
    _process.stop_beating.set()
    if _process.heartbeat is not None:
        _process.heartbeat.join(timeout=2.0)


def _beat(store, rank: int) -> None:
    told, told_call = None, None
    try:
        if isinstance(store, dist.TCPStore):  # its own connection: the main thread's calls never wait behind it
            store = dist.TCPStore(
                store.host, store.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10)
            )
        while not _process.stop_beating.is_set():
            store.add(f"{PREFIX}alive/{rank}", 1)
            if _process.state != told:
                told = _process.state
                store.set(f"{PREFIX}state/{rank}", told)
            if _process.call != told_call:
                told_call = _process.call
                store.set(f"{PREFIX}call/{rank}", str(told_call))
            _process.stop_beating.wait(BEAT)
    except Exception:  # the store went away: the job is over
        return


def _waiter() -> ThreadPoolExecutor:
    if _process.waiter is None or os.getpid() != getattr(_process.waiter, "_ringpass_pid", None):
        _process.waiter = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ringpass-wait")
        _process.waiter._ringpass_pid = os.getpid()
    return _process.waiter
