"""Which copies a decode's host pool gives up first when it needs room (``kvloop_host_eviction``).

The pool (host/tier.py; ``kvloop bench replay`` models it with these same classes) tells its policy
when a run enters it (:meth:`EvictionPolicy.add`) and leaves it (:meth:`EvictionPolicy.forget`), and
of every turn that ends on the decode (:meth:`EvictionPolicy.turn`); it releases copies in the order
:meth:`EvictionPolicy.victims` gives, skipping the ones it cannot release yet.

- ``lru``: the copy that entered the pool first goes first. A conversation's next turn makes a newer
  copy, so the oldest copy is the conversation least recently active.
- ``predicted_return``: the copy with the fewest pulls to expect per second it holds its slots goes
  first. What the decode knows is the conversation chain (a run that starts with an earlier run's
  blocks is that conversation's next turn), so it learns each conversation's gaps between turns and
  how many turns it had, and how long each has been idle. A copy behind a later turn of its own
  conversation is worth nothing (the next prompt resends the later turn too) and goes first of all.

Where all conversations draw their gaps from one distribution, how long one has been idle is the only
signal, and ``predicted_return`` ranks the latest copies by it, as ``lru`` does (for the spreads of
gaps seen in agent and chat traffic the expected pulls per second fall as a copy ages); it can only
differ where conversations differ (agents back within seconds, people after minutes).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

LRU = "lru"
PREDICTED_RETURN = "predicted_return"
POLICIES = (LRU, PREDICTED_RETURN)

# A pool starts releasing copies (its policy's first) when fewer than this share of its slots are
# free, so that the next runs find room (a released copy's slots stay fenced for a read window) ...
FREE_LOW = 0.1
# ... and releases until this share is free or coming free.
FREE_TARGET = 0.25


def room_wanted(free: int, needed: int, slots: int) -> int:
    """How many slots a pool of ``slots`` wants free or coming free before it places a run that takes
    ``needed`` more, when ``free`` are free now; 0: it has room, nothing to release."""
    if free >= max(needed, FREE_LOW * slots):
        return 0
    return max(needed, int(FREE_TARGET * slots))


class EvictionPolicy(ABC):
    """The order in which a pool gives its runs up. Keys are the pool's own (a copy's handle); times
    are seconds on one clock of the caller's (the connector's ``perf_counter``, the replay's trace)."""

    name: ClassVar[str]

    def __init__(self) -> None:
        self._keys: dict[str, None] = {}  # in the order they entered the pool

    def turn(self, hashes: Sequence[bytes], at: float) -> None:  # noqa: B027 - optional
        """A turn ended at ``at`` on the decode with a retained run of blocks ``hashes``, whether or
        not the pool takes a copy of it."""

    def add(self, key: str, hashes: Sequence[bytes], at: float) -> None:
        """Run ``key`` (blocks ``hashes``, its turn ended at ``at``) entered the pool."""
        self._keys[key] = None

    def forget(self, key: str) -> None:
        """``key`` left the pool (released, expired or never copied)."""
        self._keys.pop(key, None)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    @abstractmethod
    def victims(self, now: float) -> list[str]:
        """Every key in the pool, the first to give up first."""


class Lru(EvictionPolicy):
    name = LRU

    def victims(self, now: float) -> list[str]:
        return list(self._keys)


# Until this many gaps between turns are seen, the gap distribution is the prior below: a median
# of 10 s and a log-spread of 1.5 (the 90% range 0.9 s to 2 minutes) make no claim on the traffic;
# they are replaced by what the decode observes as soon as it has seen a few dozen turns.
MIN_SAMPLES = 32
PRIOR_GAP_S = 10.0
PRIOR_SIGMA = 1.5
# Conversations are classed by the turns seen so far (1, 2, ..., this or more) for the chance they
# continue: with a mix of long agent loops and short chats, one that has gone on is likelier to go on.
MAX_CLASS = 8
# For that chance, a conversation idle past this quantile of the gaps seen counts as ended (undone if
# it comes back); waiting for the whole lease would leave a short run nothing to learn from.
ENDED_Z = 2.326  # the 99th percentile of a normal


@dataclass
class _Conversation:
    last_at: float  # when its latest turn ended
    tail: bytes  # its latest run's last block hash
    turns: int = 1
    n: int = 0  # gaps seen, and their log's mean and sum of squared deviations (Welford)
    mean: float = 0.0
    m2: float = 0.0
    ended: bool = False  # counted as ended for its class's continuation chance


@dataclass
class _Entry:
    conversation: int
    at: float
    tail: bytes


class PredictedReturn(EvictionPolicy):
    """Gives up first the copy with the fewest pulls to expect per second it would be held.

    A copy is worth the pull it may serve, and costs its slots for as long as it waits for it: a
    conversation sure to come back in ten minutes holds its slots all that while, when they could have
    served several that come back within seconds. So copies are ranked by hit density, as caches that
    maximise hits rank objects (least hit density, LHD: pulls expected over slot-seconds expected; a
    pull's worth and a copy's slots both grow with its length, so the length cancels). For a copy
    whose conversation has been idle ``t`` s since its turn, with ``S(s)`` the chance a gap exceeds
    ``s``, ``p`` the chance the conversation has another turn at all and ``H`` the horizon
    (``horizon_s``, after which the copy cannot be pulled)::

        pulls expected        p (S(t) - S(H))
        ---------------- = -----------------------------------------
        seconds held        p integral_t^H S(s) ds + (1 - p) (H - t)

    (both over the chance it has not come back by ``t``, which cancels): the copy is held until its
    conversation comes back or the horizon, whichever is first.

    The log of a gap is taken as normal. A conversation's own mean log gap is shrunk towards the
    pool's by how much conversations differ (between-conversation variance against the spread
    within one, both learned online): a conversation with no gap yet gets the pool's distribution,
    one with many gets close to its own, and where conversations do not differ every one gets the
    pool's. ``p`` is learned per class of turns seen. A copy behind a later turn of its own
    conversation goes first; ties go in the order copies entered the pool, so the order is
    deterministic."""

    name = PREDICTED_RETURN

    def __init__(self, horizon_s: float) -> None:
        super().__init__()
        self.horizon_s = horizon_s
        self._entries: dict[str, _Entry] = {}
        self._conversations: OrderedDict[int, _Conversation] = OrderedDict()  # least recent first
        self._by_tail: dict[bytes, int] = {}  # a conversation's latest run's last hash -> it
        self._next_id = 0
        # every gap's log (Welford), and the within-conversation sum of squares and its degrees
        self._n = 0
        self._mean = 0.0
        self._m2 = 0.0
        self._within_m2 = 0.0
        self._within_dof = 0
        # per class of turns seen: conversations that went on to another turn, and that ended
        self._continued = [0] * (MAX_CLASS + 1)
        self._ended = [0] * (MAX_CLASS + 1)

    # ---- learning ------------------------------------------------------------------------------

    def turn(self, hashes: Sequence[bytes], at: float) -> None:
        if hashes:
            self._conversation_of(hashes, at)

    def _conversation_of(self, hashes: Sequence[bytes], at: float) -> int:
        """The conversation a run of ``hashes`` belongs to: one whose latest run it starts with
        (block hashes chain their prefix, so a run's last hash found in it means the whole run is
        its prefix; the deepest such is the most specific), else a new one."""
        known = self._by_tail.get(hashes[-1])
        if known is not None:
            return known  # this run seen already
        self._retire(at)
        for h in reversed(hashes[:-1]):
            cid = self._by_tail.get(h)
            if cid is not None:
                self._next_turn(cid, self._conversations[cid], hashes[-1], at)
                return cid
        cid, self._next_id = self._next_id, self._next_id + 1
        self._conversations[cid] = _Conversation(at, hashes[-1])
        self._by_tail[hashes[-1]] = cid
        return cid

    def _next_turn(self, cid: int, c: _Conversation, tail: bytes, at: float) -> None:
        k = min(c.turns, MAX_CLASS)
        if c.ended:  # it came back after all
            c.ended = False
            self._ended[k] -= 1
        self._continued[k] += 1
        gap = at - c.last_at
        if gap > 0:
            self._learn(c, math.log(gap))
        del self._by_tail[c.tail]
        c.tail, c.last_at, c.turns = tail, max(c.last_at, at), c.turns + 1
        self._by_tail[tail] = cid
        self._conversations.move_to_end(cid)

    def _learn(self, c: _Conversation, x: float) -> None:
        self._n += 1
        d = x - self._mean
        self._mean += d / self._n
        self._m2 += d * (x - self._mean)
        c.n += 1
        d = x - c.mean
        c.mean += d / c.n
        step = d * (x - c.mean)
        c.m2 += step
        self._within_m2 += step
        self._within_dof += c.n > 1

    def _retire(self, now: float) -> None:
        """Count the conversations idle past the ended threshold as ended; forget those idle past the
        horizon (nothing of theirs can be pulled any more)."""
        ended_after = min(self.horizon_s, math.exp(self._mu0() + ENDED_Z * math.sqrt(self._var_total())))
        for cid, c in list(self._conversations.items()):
            idle = now - c.last_at
            if idle <= ended_after:
                break  # least recent first: the rest are younger
            if not c.ended:
                c.ended = True
                self._ended[min(c.turns, MAX_CLASS)] += 1
            if idle > self.horizon_s:
                del self._conversations[cid]
                del self._by_tail[c.tail]

    # ---- the pool -------------------------------------------------------------------------------

    def add(self, key: str, hashes: Sequence[bytes], at: float) -> None:
        super().add(key, hashes, at)
        if hashes:
            self._entries[key] = _Entry(self._conversation_of(hashes, at), at, hashes[-1])

    def forget(self, key: str) -> None:
        super().forget(key)
        self._entries.pop(key, None)

    def victims(self, now: float) -> list[str]:
        self._retire(now)
        scores = {key: self.score(key, now) for key in self._keys}
        return sorted(self._keys, key=scores.__getitem__)  # stable: ties oldest first

    def score(self, key: str, now: float) -> float:
        """The copy ``key``'s pulls expected per second held (-1: behind a later turn)."""
        e = self._entries.get(key)
        if e is None:
            return 0.0
        c = self._conversations.get(e.conversation)
        if c is None:
            return 0.0  # idle past the horizon
        if c.tail != e.tail:
            return -1.0
        idle, horizon = max(now - e.at, 0.0), self.horizon_s
        if idle >= horizon:
            return 0.0
        mu, sd = self._gap_of(c)
        p = self.continue_chance(c.turns)
        pulls = p * (_survival(idle, mu, sd) - _survival(horizon, mu, sd))
        held = p * _held(idle, horizon, mu, sd) + (1.0 - p) * (horizon - idle)
        return pulls / held

    # ---- estimates -----------------------------------------------------------------------------

    def _learned(self) -> bool:
        return self._n >= MIN_SAMPLES

    def _mu0(self) -> float:
        return self._mean if self._learned() else math.log(PRIOR_GAP_S)

    def _var_total(self) -> float:
        return max(self._m2 / (self._n - 1), 1e-6) if self._learned() else PRIOR_SIGMA**2

    def _gap_of(self, c: _Conversation) -> tuple[float, float]:
        """Mean and standard deviation of the log of conversation ``c``'s next gap."""
        var_total, mu0 = self._var_total(), self._mu0()
        if not self._learned() or c.n == 0:
            return mu0, math.sqrt(var_total)
        var_w = self._within_m2 / self._within_dof if self._within_dof >= MIN_SAMPLES else var_total
        var_w = max(min(var_w, var_total), 1e-6)
        # between-conversation variance: what the spread of all gaps has beyond the spread within one
        tau2 = max(var_total - var_w, 1e-6)
        precision = 1.0 / tau2 + c.n / var_w
        mu = (mu0 / tau2 + c.n * c.mean / var_w) / precision
        return mu, math.sqrt(var_w + 1.0 / precision)

    def continue_chance(self, turns: int) -> float:
        """The chance a conversation with ``turns`` turns so far has another (one of each as a prior)."""
        k = min(turns, MAX_CLASS)
        return (self._continued[k] + 1) / (self._continued[k] + self._ended[k] + 2)


def _survival(t: float, mu: float, sd: float) -> float:
    """P(gap > t) for a gap whose log is normal(mu, sd)."""
    if t <= 0:
        return 1.0
    return 0.5 * math.erfc((math.log(t) - mu) / (sd * math.sqrt(2.0)))


def _held(a: float, b: float, mu: float, sd: float) -> float:
    """The integral of P(gap > s) over a <= s <= b, for a gap whose log is normal(mu, sd): by parts,
    b S(b) - a S(a) plus the gap's mean restricted to [a, b] (a log-normal's partial expectation)."""
    partial = math.exp(mu + sd * sd / 2) * (_cdf(_z(b, mu, sd) - sd) - _cdf(_z(a, mu, sd) - sd))
    return b * _survival(b, mu, sd) - a * _survival(a, mu, sd) + partial


def _z(t: float, mu: float, sd: float) -> float:
    return (math.log(t) - mu) / sd if t > 0 else -math.inf


def _cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def eviction_policy(name: str, horizon_s: float) -> EvictionPolicy:
    """The policy called ``name``; ``horizon_s``: how long after its turn a copy can still be pulled."""
    if name == LRU:
        return Lru()
    if name == PREDICTED_RETURN:
        return PredictedReturn(horizon_s)
    raise ValueError(f"unknown host eviction policy {name!r}: choose from {', '.join(POLICIES)}")
