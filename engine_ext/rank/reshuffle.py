"""Expert moves into an operation's new layout over its EPLB communicator.

A scale moves what fits ahead of its commit (``precopy``, in prepare, while the old world serves:
expert weights do not change while serving, so the senders read their live storage); its commit
moves the rest (the plan's split, engine_ext/elastic/precopy.py) into buffers carved from the idle
MoE workspace, then loads every buffer into its slot (``apply``); a recovery, whose sources just
died or may be half moved, moves them in one go (``run``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from engine_ext.elastic.eplb import ExpertMove, old_positions, plan_moves
from engine_ext.elastic.weight_source import WeightSource
from engine_ext.elastic.workspace import bytes_for
from engine_ext.rank.operation import OpState, PreCopy, comm_members
from engine_ext.rank.shared import RankResources, RankShared

TAG_BASE = 1000  # dense transfers use tags below it (engine_ext/rank/transition.py)


class ExpertReshuffle:
    """Moves expert weights into an operation's new layout over its EPLB communicator; experts
    whose every copy died come from the weight source (a checkpoint loader in production)."""

    def __init__(
        self,
        res: RankResources,
        shared: RankShared,
        weight_source: WeightSource,
        pool_blocks: Callable[[int], int] | None = None,
    ) -> None:
        self.res = res
        self.shared = shared
        self.weight_source = weight_source
        # Warmup.kv_pool_blocks: the KV blocks the rank's budget leaves beside so many bytes of
        # workspace (and spare buffers): a pre-copy's spare buffers come out of the KV pool.
        self.pool_blocks = pool_blocks

    def _pieces(self, slot: int, flat: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The contiguous per-layer parts of one expert, as sent: storage views, or views of
        ``flat`` (laid out as ``load_expert_vector`` reads it). Sending views of the storage needs
        no packed copy (packing cost seconds per GiB at the senders)."""
        w1, w2 = self.res.model.w1, self.res.model.w2
        layers = w1.shape[0]
        if flat is None:
            return [w[layer, slot] for layer in range(layers) for w in (w1, w2)]
        n1 = w1[0, 0].numel()
        a = flat[: layers * n1].view(layers, *w1.shape[2:])
        b = flat[layers * n1 :].view(layers, *w2.shape[2:])
        return [t[layer] for layer in range(layers) for t in (a, b)]

    def _schedule(
        self,
        op: OpState,
        moves: list[ExpertMove],
        into_storage: bool,
        take: Callable[[int], bool] = lambda i: True,
        new_buffer: Callable[[], torch.Tensor] | None = None,
    ) -> tuple[list, list, list, list, list]:
        """(sends, recvs, local copies, weight-source restores, landing buffers) of this rank's moves
        whose index ``take`` accepts; buffers from ``new_buffer`` (default: fresh memory)."""
        plan, model, me = op.plan, self.res.model, self.shared.rank
        old_w, new_w, comm_world = plan.old_world, plan.new_world, comm_members(plan)
        per_move = 2 * model.w1.shape[0]
        sends, recvs, local, restored, landing = [], [], [], [], []
        vec_len = model.w1[:, 0].numel() + model.w2[:, 0].numel()
        alloc = new_buffer or (lambda: torch.empty(vec_len, dtype=model.dtype, device=self.res.device))
        for i, m in enumerate(moves):
            if not take(i):
                continue
            src_g = old_w[m.src_rank] if m.src_rank >= 0 else -1
            dst_g = new_w[m.dst_rank]
            tags = range(TAG_BASE + i * per_move, TAG_BASE + (i + 1) * per_move)
            if m.from_weight_source and dst_g == me:
                restored.append(m)
            elif src_g == me and dst_g == me:
                if m.src_slot != m.dst_slot:  # else the slot keeps its expert: nothing to copy
                    # A copy taken before anything is loaded: another local move may overwrite the slot.
                    buf = alloc()
                    for t, piece in zip(self._pieces(m.dst_slot, buf), self._pieces(m.src_slot)):
                        t.copy_(piece)
                    local.append((m, buf))
            elif src_g == me:
                peer = comm_world.index(dst_g)
                sends += [(t, peer, tag) for t, tag in zip(self._pieces(m.src_slot), tags)]
            elif dst_g == me and src_g >= 0:
                peer = comm_world.index(src_g)
                if into_storage:
                    targets = self._pieces(m.dst_slot)
                else:
                    buf = alloc()
                    landing.append((m, buf))
                    targets = self._pieces(m.dst_slot, buf)
                recvs += [(t, peer, tag) for t, tag in zip(targets, tags)]
        return sends, recvs, local, restored, landing

    def run(self, op: OpState) -> dict[str, Any]:
        """This rank's sends, receives, local copies and restores of ``op``'s expert moves."""
        plan, model = op.plan, self.res.model
        old_w, new_w = plan.old_world, plan.new_world
        alive = {p for p, m in enumerate(old_w) if plan.kind != "recover" or (m in new_w and m not in plan.untrusted)}
        moves = plan_moves(
            plan.old_layout,
            plan.new_layout,
            alive,
            missing_ok=plan.kind == "recover",
            old_pos=old_positions(old_w, new_w),
        )
        comm = op.eplb_comm
        assert comm is not None
        t0 = time.perf_counter()
        # A joiner's slots hold placeholders: it receives straight into them (a failed commit
        # drops the joiner). A member's slots serve until the exchange succeeded, so what it
        # receives lands in a buffer and is loaded after: a failed exchange leaves them whole.
        into_storage = plan.role(self.shared.rank) == "joining"
        per_move = 2 * model.w1.shape[0]
        t_clone = time.perf_counter()
        sends, recvs, local, restored, landing = self._schedule(op, moves, into_storage)
        t_pack = time.perf_counter()
        comm.exchange(sends, recvs)
        t_exchange = time.perf_counter()
        for m, vec in local:
            model.load_expert_vector(m.dst_slot, vec)
        for m, buf in landing:
            model.load_expert_vector(m.dst_slot, buf)
        for m in restored if not self.res.faults.active("no_weight_source_restore") else []:
            model.load_expert_vector(m.dst_slot, self.from_weight_source(m.logical))
        assert self.res.cfg.slots_per_rank == plan.new_layout.slots_per_rank
        t_load = time.perf_counter()
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {
            "moves_total": len(moves),
            "sent": len(sends) // per_move,
            "received": len(recvs) // per_move,
            "local": len(local),
            "received_into_storage": into_storage,
            "bytes_sent": nbytes(t for t, _, _ in sends),
            "bytes_received": nbytes(t for t, _, _ in recvs),
            "restored_from_weight_source": sorted({m.logical for m in restored}),
            # where the time goes (benchmarks/curves.py): clone_s is 0 since the storage is no
            # longer snapshot; pack_s is the local moves' copies and a member's landing
            # buffers (sends go from the storage), then the gloo exchange, and loading the
            # landed and local experts into their slots
            "clone_s": t_clone - t0,
            "pack_s": t_pack - t_clone,
            "exchange_s": t_exchange - t_pack,
            "load_s": t_load - t_exchange,
        }

    def from_weight_source(self, logical: int) -> torch.Tensor:
        """One expert's (w1, w2) of every layer, flattened as ``load_expert_vector`` wants it."""
        pairs = [self.weight_source.expert(layer, logical) for layer in range(self.res.cfg.num_layers)]
        w1 = torch.stack([a for a, _ in pairs]).to(self.res.device)
        w2 = torch.stack([b for _, b in pairs]).to(self.res.device)
        return torch.cat([w1.reshape(-1), w2.reshape(-1)])

    # ---- a scale: moves before the commit, the commit only loads -----------------------------------
    def precopy(self, op: OpState) -> dict[str, Any]:
        """Receive the experts the new layout gives this rank, as far as the plan's split
        (``precopy_moves``) takes them, while the old world serves: a joiner
        into its slots (placeholders nobody serves from), a member into spare buffers (its slots
        serve until the switch; a failure before it leaves them whole). One exchange per move, in
        the plan's order (every rank walks the same order, so none waits on a move its peer has
        not reached); ``hold:precopy`` keeps a rank after its first of several (mid pre-copy)."""
        plan, res, model = op.plan, self.res, self.res.model
        moves = plan_moves(
            plan.old_layout,
            plan.new_layout,
            set(range(plan.old_size)),
            old_pos=old_positions(plan.old_world, plan.new_world),
        )
        comm = op.eplb_comm
        assert comm is not None
        per_move = 2 * model.w1.shape[0]
        # "precopy_into_live_slots": a member receives straight into the slots it serves from.
        into_storage = op.role == "joining" or res.faults.active("precopy_into_live_slots")
        t0 = time.perf_counter()
        sends, recvs, local, _, landing = self._schedule(op, moves, into_storage, self._in_precopy(plan))
        held = local + landing  # local copies are taken now: another move may overwrite their source slot
        spare = sum(buf.numel() * buf.element_size() for _, buf in held)
        self._hold_spare(op, held, spare)
        t_pack = time.perf_counter()
        move_bytes = model.w1.shape[0] * (model.w1[0, 0].nbytes + model.w2[0, 0].nbytes)
        peer = comm.moves  # same-host moves say where their time went
        per_batch = max(1, res.cfg.move_batch_bytes // max(1, move_bytes))
        if res.cfg.move_batch_bytes and peer is not None and not peer.stages:
            per_batch = len(moves) or 1  # nothing staged (CUDA IPC): all in one exchange, one handshake a pair
        batches = _batches(sends, recvs, per_move, per_batch)
        before = dict(peer.seconds) if peer is not None else {}
        for k, batch in enumerate(batches):
            comm.exchange(*batch)
            if k == 0 and len(batches) > 1:
                res.faults.hold("precopy")
        t_exchange = time.perf_counter()
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {
            "moves_total": len(moves),
            "sent": len(sends) // per_move,
            "received": len(recvs) // per_move,
            "local": len(local),
            "received_into_storage": into_storage,
            "exchanges": len(batches),
            "bytes_sent": nbytes(t for t, _, _ in sends),
            "bytes_received": nbytes(t for t, _, _ in recvs),
            "spare_bytes": spare,
            "pack_s": t_pack - t0,
            "exchange_s": t_exchange - t_pack,
            **{f"move_{part}": peer.seconds[part] - s for part, s in before.items()},
        }

    @staticmethod
    def _in_precopy(plan: Any) -> Callable[[int], bool]:
        """Whether move ``i`` is the pre-copy's (the plan's split; without one, every move is)."""
        chosen = None if plan.precopy_moves is None else frozenset(plan.precopy_moves)
        return lambda i: chosen is None or i in chosen

    def _account(self, nbytes: int) -> None:
        """Take ``nbytes`` of expert buffers out of the KV pool (the rank's budget is KV +
        workspace + spare), or give them back with 0; status shows them as ``move_bytes_held``."""
        res, shared = self.res, self.shared
        with shared.lock:
            if self.pool_blocks is not None:
                res.sched.blocks.resize(self.pool_blocks(res.workspace.nbytes + nbytes))
            shared.move_bytes_held = nbytes

    def _hold_spare(self, op: OpState, held: list, nbytes: int) -> None:
        """Keep the spare buffers in ``op`` and their bytes out of the KV pool until
        ``OpState.free_precopy`` gives them back."""
        if nbytes:
            self._account(nbytes)
        op.precopy = PreCopy(held, nbytes, time.time(), lambda: self._account(0) if nbytes else None)

    def _commit_buffers(self) -> tuple[Callable[[], torch.Tensor], Callable[[], int]]:
        """Buffers for the commit's moves: carved from the MoE workspace (no forward pass runs until
        the re-warm after the load), then fresh memory; and how many bytes the fresh ones took."""
        model, ws = self.res.model, self.res.workspace
        vec_len = model.w1[:, 0].numel() + model.w2[:, 0].numel()
        spec = ((vec_len,), model.dtype)
        fits = ws.nbytes // bytes_for([spec]) if ws.nbytes else 0
        carved = list(reversed(ws.get([spec] * fits))) if fits else []
        extra = [0]

        def new_buffer() -> torch.Tensor:
            if carved:
                return carved.pop()
            extra[0] += vec_len * model.w1.element_size()
            return torch.empty(vec_len, dtype=model.dtype, device=self.res.device)

        return new_buffer, lambda: extra[0]

    def _load_threads(self, comm: Any, loaded: list[tuple[Any, torch.Tensor]]) -> int:
        """How many threads load the commit's buffers on a CPU rank: ``commit_load_threads``, or
        (0) the usable cores over the ranks of a one-host world (its same-host transport says the
        world is on one host; across hosts their ranks per host are unknown: 1), no more than
        ``OMP_NUM_THREADS`` where it is set (Ray sets it to a rank's CPU grant), at most 8 and one
        per 8 MiB loaded (starting a thread costs ~0.5 ms; 8 MiB copy in ~1.5 ms)."""
        slots = len({m.dst_slot for m, _ in loaded})
        if self.res.device.type != "cpu" or slots < 2:
            return 1
        k = self.res.cfg.commit_load_threads
        if k == 0:
            k = len(os.sched_getaffinity(0)) // comm.size if getattr(comm, "transport_kind", "") == "shm" else 1
            granted = os.environ.get("OMP_NUM_THREADS", "")
            k = min(
                k,
                int(granted) if granted.isdigit() else k,
                8,
                sum(buf.numel() * buf.element_size() for _, buf in loaded) // (8 << 20),
            )
        return max(1, min(k, slots))

    def _pack_commit(
        self, op: OpState, moves: list[ExpertMove], take: Callable[[int], bool]
    ) -> tuple[list, list, list, list, Callable[[], int]]:
        """(sends, recvs, local copies, landing buffers, extra) of the commit's moves ``take``
        accepts, into the commit's buffers. What the workspace could not hold (``extra()`` bytes)
        comes out of the KV pool too, for the pause: accounted here, given back by the pre-copy's
        release (the commit's load, or a failed commit's abort)."""
        new_buffer, extra = self._commit_buffers()
        sends, recvs, local, _, landing = self._schedule(op, moves, op.role == "joining", take, new_buffer)
        pc = op.precopy
        if extra():
            self._account((pc.nbytes if pc is not None else 0) + extra())
            if pc is None:
                op.precopy = pc = PreCopy([], 0, time.time(), lambda: None)
            pc.release = lambda: self._account(0)
        return sends, recvs, local, landing, extra

    def apply(self, op: OpState) -> dict[str, Any]:
        """At the commit: move what the pre-copy left (the plan's split: received into buffers and
        local copies, as a recovery's move), then copy every buffer, pre-copied or not, into the slot
        whose expert changes, and free them. A failure before the loads leaves the slots whole."""
        plan, model = op.plan, self.res.model
        comm = op.eplb_comm
        assert comm is not None
        in_pre = self._in_precopy(plan)
        moves = plan_moves(
            plan.old_layout,
            plan.new_layout,
            set(range(plan.old_size)),
            old_pos=old_positions(plan.old_world, plan.new_world),
        )
        t0 = time.perf_counter()
        sends, recvs, local, landing, extra = self._pack_commit(op, moves, lambda i: not in_pre(i))
        pc = op.precopy
        t_pack = time.perf_counter()
        comm.exchange(sends, recvs)
        t_exchange = time.perf_counter()
        sent, received = _nbytes(t for t, _, _ in sends), _nbytes(t for t, _, _ in recvs)
        sends.clear()
        recvs.clear()  # (views of the landing buffers, which are freed off the pause below)
        loaded = [*(pc.held if pc is not None else []), *local, *landing]
        threads = self._load_threads(comm, loaded)
        _load(model, loaded, threads)
        copied = _nbytes(buf for _, buf in loaded)
        moved = _nbytes(buf for _, buf in local + landing)
        commit_moves = len(local) + len(landing)
        t_load = time.perf_counter()
        freed = op.free_precopy("commit")
        if pc is not None:
            pc.held = []
        local.clear()
        landing.clear()
        if self.res.device.type == "cpu":  # (a device's caching allocator frees at once)
            _release_off_pause(loaded)
        # the operation record's move_memory: what was held, and what of the move the commit made
        op.result["move_memory"] = freed = {**freed, "commit_moved_bytes": moved, "commit_extra_bytes": extra()}
        return {
            "commit_copy_bytes": copied,
            "commit_moved_bytes": moved,
            "commit_moves": commit_moves,
            "load_threads": threads,
            "commit_bytes_sent": sent,
            "commit_bytes_received": received,
            "commit_extra_bytes": extra(),
            "pack_s": t_pack - t0,
            "exchange_s": t_exchange - t_pack,
            "load_s": t_load - t_exchange,
            **freed,
        }


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _load(model: Any, loaded: list[tuple[Any, torch.Tensor]], threads: int) -> None:
    """Copy each landed expert into its slot; with ``threads`` > 1 the slots are dealt round-robin
    to that many threads (a torch copy releases the GIL; one slot's loads stay on one thread, in
    order)."""

    def load_part(part: list[tuple[Any, torch.Tensor]]) -> None:
        for m, buf in part:
            model.load_expert_vector(m.dst_slot, buf)

    if threads <= 1:
        load_part(loaded)
        return
    slots = sorted({m.dst_slot for m, _ in loaded})
    worker = {slot: i % threads for i, slot in enumerate(slots)}
    parts: list[list[tuple[Any, torch.Tensor]]] = [[] for _ in range(threads)]
    for item in loaded:
        parts[worker[item[0].dst_slot]].append(item)
    with ThreadPoolExecutor(threads, thread_name_prefix="commit-load") as pool:
        list(pool.map(load_part, parts))  # (list: a worker's exception is raised here)


def _release_off_pause(buffers: list[Any]) -> None:
    """Drop the commit's landed buffers on a thread of their own, after the loads: returning
    touched memory to the OS took 3 ms per 128 MiB inside the serving pause (benchmarks/curves.py,
    the 2-core box). ``buffers`` is the last reference to them; the KV pool got their bytes back
    already (the accounting is the budget's: the KV tensor is allocated whole at start)."""
    threading.Thread(target=buffers.clear, name="free-landed-experts", daemon=True).start()


def _batches(sends: list, recvs: list, per_move: int, moves_per_batch: int) -> list[tuple[list, list]]:
    """This rank's (sends, recvs) per exchange: moves ``moves_per_batch`` at a time by the plan's
    move number (every rank cuts the same ranges, so the n-th exchange of a pair is the same on
    both sides), skipping ranges this rank has no part in."""
    by_batch: dict[int, tuple[list, list]] = {}
    for side, items in ((0, sends), (1, recvs)):
        for item in items:
            by_batch.setdefault((item[2] - TAG_BASE) // per_move // moves_per_batch, ([], []))[side].append(item)
    return [by_batch[b] for b in sorted(by_batch)]
