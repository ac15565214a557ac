"""Expert placement (EPLB): logical experts onto physical slots, and the moves between layouts.

Following upstream elastic EP, the number of physical slots per rank stays constant, so a
world of W ranks holds ``slots_per_rank * W`` physical experts and the redundant count
changes with W. Pure Python: the controller plans with it without torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ExpertLayout:
    num_logical: int
    slots_per_rank: int
    world_size: int
    phys_to_logical: tuple[int, ...]

    @property
    def num_physical(self) -> int:
        return self.slots_per_rank * self.world_size

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    def rank_of(self, phys: int) -> int:
        return phys // self.slots_per_rank

    def local_logical(self, rank: int) -> list[int]:
        start = rank * self.slots_per_rank
        return list(self.phys_to_logical[start : start + self.slots_per_rank])

    def replicas(self, logical: int) -> list[int]:
        return [p for p, e in enumerate(self.phys_to_logical) if e == logical]

    def replica_table(self) -> tuple[list[list[int]], list[int]]:
        """(replicas padded to the max count, replica count) per logical expert."""
        reps = [self.replicas(e) for e in range(self.num_logical)]
        width = max(len(r) for r in reps)
        return [r + [r[0]] * (width - len(r)) for r in reps], [len(r) for r in reps]

    def to_dict(self) -> dict:
        return {
            "num_logical": self.num_logical,
            "slots_per_rank": self.slots_per_rank,
            "world_size": self.world_size,
            "phys_to_logical": list(self.phys_to_logical),
        }

    @classmethod
    def from_dict(cls, d: dict) -> ExpertLayout:
        return cls(d["num_logical"], d["slots_per_rank"], d["world_size"], tuple(d["phys_to_logical"]))


def min_world_size(num_logical: int, slots_per_rank: int) -> int:
    return -(-num_logical // slots_per_rank)


STICKY_TOLERANCE = 0.1  # ranks keep their experts while the busiest rank stays within 10 % of balanced


def build_layout(
    num_logical: int,
    slots_per_rank: int,
    world_size: int,
    load: list[float] | None = None,
    previous: ExpertLayout | None = None,
) -> ExpertLayout:
    """Replicate the busiest experts into the spare slots, then spread replicas over ranks.

    Every logical expert gets at least one slot. With ``previous`` given, ranks keep the experts
    they held (the rest dealt to the least loaded) unless that leaves the busiest rank more than
    ``STICKY_TOLERANCE`` above the balanced layout's; either way a replica stays on a rank that
    held it when the loads tie, which keeps moves few.
    """
    total = slots_per_rank * world_size
    if total < num_logical:
        raise ValueError(
            f"{world_size} ranks x {slots_per_rank} slots cannot hold {num_logical} experts; "
            f"need at least {min_world_size(num_logical, slots_per_rank)} ranks"
        )
    weights = [1.0] * num_logical if not load or sum(load) <= 0 else [float(x) + 1e-9 for x in load]
    counts = [1] * num_logical
    for _ in range(total - num_logical):
        e = max(range(num_logical), key=lambda i: (weights[i] / counts[i], -i))
        counts[e] += 1
    replicas = [(weights[e] / counts[e], e) for e in range(num_logical) for _ in range(counts[e])]
    replicas.sort(key=lambda r: (-r[0], r[1]))
    held_before: list[set[int]] = [set() for _ in range(world_size)]
    if previous is not None:
        for r in range(min(world_size, previous.world_size)):
            held_before[r] = set(previous.local_logical(r))

    def deal(slots: list[list[int]], rank_load: list[float], replicas: list[tuple[float, int]]) -> None:
        for w, e in replicas:
            free = [r for r in range(world_size) if len(slots[r]) < slots_per_rank]
            distinct = [r for r in free if e not in slots[r]] or free
            r = min(distinct, key=lambda q: (round(rank_load[q], 9), e not in held_before[q], q))
            slots[r].append(e)
            rank_load[r] += w

    slots: list[list[int]] = [[] for _ in range(world_size)]
    rank_load = [0.0] * world_size
    deal(slots, rank_load, replicas)
    if previous is not None:
        # Balancing first re-deals survivors' slots even under an even load (a 2 -> 4 scale moved
        # 3 GiB where the joiners needed 2 GiB). A layout where each rank first keeps what it held
        # is taken instead when its busiest rank is within STICKY_TOLERANCE of the balanced one's.
        kept, kept_load = _keep_held(replicas, held_before, slots_per_rank, deal)
        if max(kept_load) <= max(rank_load) * (1 + STICKY_TOLERANCE) + 1e-9:
            slots = kept
    phys = tuple(e for r in range(world_size) for e in sorted(slots[r]))
    return ExpertLayout(num_logical, slots_per_rank, world_size, phys)


def _keep_held(
    replicas: list[tuple[float, int]],
    held_before: list[set[int]],
    slots_per_rank: int,
    deal: Callable[[list[list[int]], list[float], list[tuple[float, int]]], None],
) -> tuple[list[list[int]], list[float]]:
    """Slots where each rank first keeps the replicas it held (heaviest first), the rest dealt."""
    kept: list[list[int]] = [[] for _ in held_before]
    load = [0.0] * len(held_before)
    left = list(replicas)
    weight = {e: w for w, e in replicas}
    for r, held in enumerate(held_before):
        for w, e in sorted(((weight[e], e) for e in held if e in weight), reverse=True):
            if (w, e) in left and len(kept[r]) < slots_per_rank:
                left.remove((w, e))
                kept[r].append(e)
                load[r] += w
    deal(kept, load, left)
    return kept, load


@dataclass(frozen=True)
class ExpertMove:
    """Copy logical expert ``logical`` from (src_rank, src_slot) into (dst_rank, dst_slot)."""

    logical: int
    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int

    @property
    def local(self) -> bool:
        return self.src_rank == self.dst_rank

    @property
    def from_weight_source(self) -> bool:
        """No live copy: the weights come from the model's weight source (recovery)."""
        return self.src_rank < 0


def old_positions(old_world: list[int] | tuple[int, ...], new_world: list[int] | tuple[int, ...]) -> list[int | None]:
    """For each position of the new world, the old position of the same rank (None: a joiner)."""
    return [old_world.index(r) if r in old_world else None for r in new_world]


def plan_moves(
    old: ExpertLayout,
    new: ExpertLayout,
    alive_sources: set[int] | None = None,
    *,
    missing_ok: bool = False,
    old_pos: list[int | None] | None = None,
) -> list[ExpertMove]:
    """Where each new physical slot gets its weights from. Local copies when possible: from the
    slots the same rank held, ``old_pos`` (``old_positions``) saying where it stood in the old world
    (by default at the same position). Without it a rank that moved down a position, after a
    lower rank left, took every expert it already held from the rank now at its old place.

    ``missing_ok`` (recovery): an expert whose every old copy died gets a move with source
    rank -1, to be restored from the model's weight source."""
    sources = alive_sources if alive_sources is not None else set(range(old.world_size))
    L_old, L_new = old.slots_per_rank, new.slots_per_rank
    holders: dict[int, list[tuple[int, int]]] = {}
    for p, e in enumerate(old.phys_to_logical):
        r = p // L_old
        if r in sources:
            holders.setdefault(e, []).append((r, p % L_old))
    moves: list[ExpertMove] = []
    used: dict[int, int] = {}
    for p, e in enumerate(new.phys_to_logical):
        dst_rank, dst_slot = p // L_new, p % L_new
        cands = holders.get(e)
        if not cands and missing_ok:
            moves.append(ExpertMove(e, -1, -1, dst_rank, dst_slot))
            continue
        if not cands:
            raise ValueError(f"logical expert {e} has no live source in the old layout")
        home = dst_rank if old_pos is None else old_pos[dst_rank]
        local = [c for c in cands if c[0] == home]
        if local:
            src = local[0]
        else:  # spread remote copies over the holders
            src = cands[used.get(e, 0) % len(cands)]
            used[e] = used.get(e, 0) + 1
        moves.append(ExpertMove(e, src[0], src[1], dst_rank, dst_slot))
    return moves


def transfer_pairs(old_size: int, new_size: int) -> dict[int, list[int]]:
    """Non-expert weight senders -> receivers for scale-up, as vLLM pairs them.

    Each of the ``old_size`` existing ranks serves ``(new-old) // old`` joining ranks, and the
    first ``(new-old) % old`` senders take one more.
    """
    if new_size <= old_size:
        return {}
    joining = list(range(old_size, new_size))
    base, extra = divmod(len(joining), old_size)
    pairs: dict[int, list[int]] = {}
    cursor = 0
    for sender in range(old_size):
        n = base + (1 if sender < extra else 0)
        if n:
            pairs[sender] = joining[cursor : cursor + n]
            cursor += n
    return pairs


EPLB_WINDOW_STEPS = 1000  # vLLM's EPLB default window_size


@dataclass
class EplbState:
    """Per-rank EPLB bookkeeping. Updated in place on a transition, never rebuilt (I2)."""

    layout: ExpertLayout
    logical_load: list[float] = field(default_factory=list)
    step: int = 0
    async_started: bool = False
    suppressed: int = 0  # >0 while warmup runs: statistics must not move (I5)
    # The last WINDOW_STEPS steps' counts, the "recent window" vLLM's EPLB balances and logs over.
    window: deque[list[int]] = field(default_factory=lambda: deque(maxlen=EPLB_WINDOW_STEPS))
    _window_total: list[int] = field(default_factory=list, repr=False)  # the window's counts, summed

    def __post_init__(self) -> None:
        if not self.logical_load:
            self.logical_load = [0.0] * self.layout.num_logical

    def record(self, counts: list[int]) -> None:
        if self.suppressed or not self.async_started:
            return
        for e, c in enumerate(counts):
            self.logical_load[e] += c
        window, total = self.window, self._window_total
        if len(window) == window.maxlen:  # the oldest step leaves the window
            for e, c in enumerate(window[0]):
                total[e] -= c
        window.append(list(counts))
        if len(total) < len(counts):
            total.extend([0] * (len(counts) - len(total)))
        for e, c in enumerate(counts):
            total[e] += c
        self.step += 1

    def recent_load(self) -> list[float]:
        """Tokens per logical expert over the recent window (all zero before any load). A running
        sum: every status carries it, and summing the 1000-step window took ~0.5 ms of a commit's
        few (each state change inside the serving pause publishes a status)."""
        n = self.layout.num_logical
        return [float(c) for c in self._window_total[:n]] + [0.0] * max(0, n - len(self._window_total))

    def imbalance(self) -> float:
        """Max over mean of the load each rank's slots carry under the current layout."""
        layout = self.layout
        if not any(self.logical_load):
            return 0.0
        reps = {e: len(layout.replicas(e)) for e in range(layout.num_logical)}
        per_rank = [0.0] * layout.world_size
        for p, e in enumerate(layout.phys_to_logical):
            per_rank[layout.rank_of(p)] += self.logical_load[e] / reps[e]
        mean = sum(per_rank) / len(per_rank)
        return round(max(per_rank) / mean, 4) if mean > 0 else 0.0

    def snapshot(self) -> tuple[int, tuple[float, ...]]:
        return self.step, tuple(self.logical_load)

    def update_layout(self, layout: ExpertLayout) -> None:
        self.layout = layout
