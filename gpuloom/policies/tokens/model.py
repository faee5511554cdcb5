"""The data the token scheduler and its policies share: configuration, shares, leases,
decisions, and the read-only view a policy decides from."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.shares import Share, share_of

# Remaining quota at or below this is "none left": a lease shorter than a microsecond is below
# the cost of one kernel launch, and it stays representable next to a monotonic clock of years.
EPSILON_S = 1e-6

ClientState = Literal["idle", "waiting", "holding", "blocked"]


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class TokenConfig:
    window_s: float = 1.0  # scheduling window W
    lease_min_s: float = 0.002  # q_min
    lease_max_s: float = 0.1  # q_max
    lease_initial_s: float = 0.02  # q before any burst is measured
    smoothing: float = 0.3  # weight of the newest burst in the smooth update (0 < s <= 1)
    fifo_slice_s: float = 0.05  # slice of the FIFO time-slice baseline
    sm_global_limit: int = 100  # SM percent that may be held at once (FaST-GShare: 100)

    def validate(self) -> None:
        """Raise ValueError naming the first field that makes no sense."""
        _positive("window_s", self.window_s)
        low = _positive("lease_min_s", self.lease_min_s)
        high = _positive("lease_max_s", self.lease_max_s)
        if high < low:
            raise ValueError(
                f"lease_max_s ({self.lease_max_s}) must be >= lease_min_s ({self.lease_min_s})"
            )
        initial = _positive("lease_initial_s", self.lease_initial_s)
        if not low <= initial <= high:
            raise ValueError(
                f"lease_initial_s ({self.lease_initial_s}) must lie in "
                f"[lease_min_s, lease_max_s] = [{low}, {high}]"
            )
        if _positive("smoothing", self.smoothing) > 1:
            raise ValueError(f"smoothing must lie in (0, 1], got {self.smoothing!r}")
        _positive("fifo_slice_s", self.fifo_slice_s)
        limit = self.sm_global_limit
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"sm_global_limit must be an integer >= 1, got {limit!r}")


@dataclass(frozen=True, slots=True)
class ClientShare:
    """What a client is entitled to: the reservation's `Share` itself, its SM partition and
    time quota per window (FaST-GShare's S_SMs, Q_request and Q_limit), read here with the
    quotas as fractions of the window. It holds the Share, not copies of its fields, so the
    time quota keeps one form from SubmitJob to the scheduler (docs/architecture.md, the walks).
    """

    client_id: str
    share: Share

    @classmethod
    def of(
        cls, client_id: str, sm_percent: int, quota_request: float, quota_limit: float
    ) -> ClientShare:
        """A client whose quotas are given as fractions of the window (the simulators' form)."""
        return cls(client_id, share_of(sm_percent, quota_request * 100, quota_limit * 100))

    @property
    def sm_percent(self) -> int:
        return self.share.sm_percent

    @property
    def quota_request(self) -> float:
        """The guaranteed fraction of each window, 0 < request <= limit <= 1."""
        return self.share.quota.request_percent / 100

    @property
    def quota_limit(self) -> float:
        """The most of each window it may use when others leave time over."""
        return self.share.quota.limit_percent / 100

    def validate(self) -> None:
        """Raise ValueError naming the first field that makes no sense. The dispatcher's shares
        were validated where they were made; a simulator's or a library caller's were not, and
        the domain's check trusts protobuf for the types, so those are checked here."""
        if not isinstance(self.client_id, str) or not self.client_id:
            raise ValueError(f"client_id must be a non-empty string, got {self.client_id!r}")
        if not isinstance(self.share, Share):
            raise ValueError(f"share must be a Share, got {type(self.share).__name__}")
        sm, quota = self.share.sm_percent, self.share.quota
        if not isinstance(sm, int) or isinstance(sm, bool):
            raise ValueError(f"share.sm_percent must be an integer, got {sm!r}")
        for name, value in (
            ("request_percent", quota.request_percent),
            ("limit_percent", quota.limit_percent),
        ):
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"share.quota.{name} must be a number, got {value!r}")
        try:
            self.share.partition.validate("share")
        except InvalidArgument as error:
            raise ValueError(error.message) from error


@dataclass(frozen=True, slots=True)
class Lease:
    """A token: the client may launch kernels from granted_at until expires_at."""

    lease_id: int  # unique per scheduler, increasing from 1
    client_id: str
    granted_at: float
    expires_at: float  # math.inf: open-ended (exclusive), held until released
    elastic: bool = False  # the client had already used its request this window

    @property
    def length_s(self) -> float:
        return self.expires_at - self.granted_at


@dataclass(frozen=True, slots=True)
class Decision:
    """What one call changed. Every lease in `ended` ended before any lease in `granted`
    started, so a client may appear in both (its old lease expired, it asked again)."""

    granted: tuple[Lease, ...] = ()
    ended: tuple[Lease, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.granted or self.ended)


NOTHING = Decision()


class ClientView(Protocol):
    """A waiting client as a policy sees it; times in seconds of this window."""

    @property
    def client_id(self) -> str: ...
    @property
    def share(self) -> ClientShare: ...
    @property
    def sm_percent(self) -> int: ...
    @property
    def request_s(self) -> float: ...  # quota_request * W
    @property
    def limit_s(self) -> float: ...  # quota_limit * W
    @property
    def used_s(self) -> float: ...  # charged this window, carried overrun included
    @property
    def q_s(self) -> float: ...  # the lease length it has earned from its bursts
    @property
    def requested_at(self) -> float: ...


class SchedulerView(Protocol):
    """The scheduler's state as a policy may read it; valid only during the call."""

    @property
    def config(self) -> TokenConfig: ...
    @property
    def now(self) -> float: ...
    @property
    def running_sm(self) -> int: ...  # SM percent held by the current leases
    @property
    def holders(self) -> int: ...  # clients holding a lease
    @property
    def waiting(self) -> Collection[ClientView]: ...  # in request order, earliest first


class TokenPolicy(Protocol):
    """Who gets a lease now, and for how long; pure and stateless."""

    @property
    def name(self) -> str: ...

    def order(self, view: SchedulerView) -> list[ClientView]:
        """The waiting clients this policy would serve now, in the order it serves them; a
        waiting client left out is blocked (for example by its quota limit)."""
        ...

    def select(self, view: SchedulerView) -> Sequence[tuple[str, float]]:
        """(client id, lease length in seconds, math.inf for open-ended) for each waiting
        client to grant a lease now."""
        ...
