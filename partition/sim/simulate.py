"""Event simulation of one Mobius pipeline step: when each load, compute, offload and update runs, on a topology.

The step is a graph of tasks (TaskGraph); a task starts at the first instant all of its dependencies have
ended. Per gpu g the visit order is the runtime's (partition.rules.order): its stages' forwards in ascending
order, then their backwards in descending order, each over microbatches i = 0..M-1.
Resources and rules (times in seconds, bytes, GB/s = 1e9 bytes/s):
  compute   one stream per gpu, in schedule order. F(j,i) starts after F(j-1,i) arrived (+ comm_s of
            stage j-1), B(j,i) after B(j+1,i) arrived (+ comm_s of stage j); F takes F_j, B takes R_j + B_j
            (the stage recomputes its forward first: recompute_s, F_j unless the profile measured it apart).
            The last stage is fused (SimStage.fused, set by partition.search.sim_stages), as the runtime
            runs it: its forward visit runs nothing, and its B(last, i) computes forward, loss and backward at
            once as soon as F(last-1, i) arrived (partition.rules.order: a 1F1B of the last stage).
  cores     with host_cores C (CPU stand-ins, whose "gpus" are host threads: Topology.measured.host_cores),
            every F and B is a flow of its seconds of one core over the link ("host", "cores") of C cores
            and its gpu's own link of 1 core: while k computations run at once each gets min(1, C / k) of
            a core. The profile is timed with one computation running, so that is a rate of 1; C is the
            cores this machine gives the run's threads at once (2 on an idle 2-core machine, fewer when
            other processes take some). The copy and host-Adam threads are not on the link: on the CPU
            runs measured (scripts/bench_fidelity.py) they take under 2% of a step.
  load      one host->gpu copy engine per gpu, in visit order, two weight slots: the load of the k-th stage
            visit starts when the previous load ended and the slot's previous holder (visit k-2) was
            released (its last microbatch computed). A gpu's last forward stage stays resident into its
            backward (no reload). The runtime issues LOAD k right after RELEASE k-2, so this is its order.
            A stage with its weights or its frozen weights on the SSD (ssd_weights, ssd_frozen) streams each
            load from the drive: the load also reads param_bytes from the SSD (see the link model).
            With memory_bytes G (partial prefetch, the Mobius paper's and partition.rules.timeline's rule): while
            visit k-1 computes, the load of visit k moves only what fits in the memory it leaves free,
            X = min(P, max(0, G - S_{k-1})) with S = param_bytes + activation_bytes (+ grad_bytes in the
            backward); the rest, P - X, is a second load after visit k-1's last microbatch. Without G (or
            when X = P) a load is one task, as above.
  offload   one gpu->host engine per gpu: after B(j, M-1) the stage's gradients go to host. One gradient
            slot: a backward visit starts after the previous offload ended. With ssd_weights the offload
            also writes grad_bytes to the SSD.
  update    each gpu's rank runs its stages' Adam one at a time on its own update thread, in the order their
            gradients arrived; the ranks' threads run at once, each at the host Adam rate (a rate per rank:
            `topology --probe` measures it with every rank updating at once, sharing the memory bandwidth). A
            stage with state on the SSD (ssd_read_bytes / ssd_write_bytes > 0) streams it through the update: the
            update takes max(update_s, ssd_s), ssd_s = ssd_read_bytes / R + ssd_write_bytes / W (R, W the
            SsdLink's GB/s; one drive serves its reads and writes in turn, so their times add), and the drive
            serves one update's stream at a time: such an update also waits for the drive to be free of the
            previous one's ssd_s.
  ssd       loads of ssd_weights and ssd_frozen stages and offloads of ssd_weights stages share the drive among
            themselves: without a topology a load takes max(load_s, param_bytes / R) and an offload max(offload_s,
            grad_bytes / W); with a topology the load's flow also crosses the link ("ssd", "read") of R GB/s and the
            offload's the link ("ssd", "write") of W GB/s, shared by processor sharing like any link. Approximations:
            the update's SSD streaming and the loads' and offloads' do not slow each other down when they overlap in
            time, nor do reads and writes (two links, where the drive takes turns), so the events can end before the
            drive has served every byte. The step is therefore never shorter than the drive's busy seconds D = all bytes
            read / R + all bytes written / W (a floor, the same D as partition.sim.bounds');
            the drive's own PCIe path is not shared with the gpus' flows (a few GB/s of NVMe next to 16-32
            GB/s links).
  comm      activations between gpus take the stage's fixed comm_s (partition.search.sim_stages). A rank that
            sends from its computing thread (CPU stand-ins) is busy send_s per message to another gpu: an F
            that sends its output, a B that sends its input gradient, are followed on its compute stream by a
            send of send_s (core work with host_cores), after which the message takes comm_s. Such a rank also
            receives on that thread: once the message has arrived and its stream reached the F or B that needs
            it, a receive of recv_s (core work with host_cores) runs before that F or B.
  loop      the training loop's own seconds per step outside the schedule, overhead_s (topology
            Measured.step_overhead_s: collectives of the loss and metrics, clipping, the next batch), are
            added to the step time (the events stay as they are).

Durations of loads and offloads (the link model):
  topology=None   each load takes its stage's load_s and each offload its offload_s (static; the planner's
                  expected contention is already in load_s). Exact for those numbers.
  topology given  a load is a flow of param_bytes host->gpu and an offload a flow of grad_bytes gpu->host
                  over the links on the gpu's path: its own PCIe link, every switch uplink above it, its
                  root complex uplink; each direction is a separate link (PCIe is full duplex). Flows share
                  links by processor sharing (FlowNet): while k flows cross a link, each gets link_gbps / k
                  of it, and a flow moves at the least share along its path, recomputed at every flow start
                  and end. This is exact for the fluid model; it is an approximation of PCIe arbitration in
                  two ways: a flow held back elsewhere does not hand its unused share to the others (the
                  rule Topology.load_gbps also uses, so the planner's estimate and the simulation agree on
                  symmetric trees), and real transfers have per-copy latency and chunking.
  swaps     a stage whose held activations live off the device (host, SSD, a peer gpu) copies them out after
            each forward and back before each backward, where the schedule's SO and SI stand, as flows on its
            paths (or static times): partition.sim.swaps. A plan made before the activation choice (tier
            auto) moves nothing here.
Not modelled (small next to a stage's weights, or outside one step): activations between gpus are not
flows (they keep their fixed comm_s but their bytes are counted in link traffic); the next step's loads
waiting for this step's updates.

The delayed update (delayed=True): the updates a step runs are the step before's, whose gradients are all there when
it starts: they run from 0, each rank's one after the other, while the pipeline computes (the steady state).

Reported: step time = when the last update (or the last compute) ends, at least D, plus overhead_s; per gpu
its compute busy seconds and fraction; bytes per link (gpu link, switch and root complex uplinks, NVLink, then
the SSD's reads and writes, of updates, loads and offloads alike, when a stage has state there); per gpu the
peak of the device arena in use (weight slots between a load's start and the visit's release, the gradient slot
between a backward visit's first microbatch and its offload's end, times the slot size W = the largest
stage's param_bytes) and the largest activation bytes of its stages.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

from partition.rules.costmodel import WEIGHT_SLOTS
from partition.rules.order import visits_of
from partition.sim.flows import FlowNet, Link, TaskGraph
from partition.sim.swaps import Swaps
from partition.sim.types import SSD_READ, SSD_WRITE, SimResult, SimStage, SsdLink
from topology import Topology

__all__ = [
    "SimStage",
    "SimResult",
    "SsdLink",
    "link_paths",
    "simulate",
    "update_seconds",
    "SSD_READ",
    "SSD_WRITE",
    "HOST_CORES",
]

HOST_CORES: Link = ("host", "cores")
"""The host's cores, in cores: the computations of CPU stand-ins share them (simulate(..., host_cores=C))."""


def link_paths(topo: Topology) -> tuple[dict[Link, float], dict[tuple[int, str], tuple[Link, ...]]]:
    """Capacities (GB/s) of every link (NVLinks too), and each gpu's path to host memory per direction ("h2d",
    "d2h")."""
    caps: dict[Link, float] = {}
    paths: dict[tuple[int, str], tuple[Link, ...]] = {}
    for g in topo.gpus:
        chain = [(f"gpu{g.index}", g.link_gbps)]
        chain += [(s, topo.switch(s).uplink_gbps) for s in topo.switch_chain(g.index)]
        chain.append((g.root_complex, topo.root_complex(g.root_complex).uplink_gbps))
        for d in ("h2d", "d2h"):
            paths[(g.index, d)] = tuple((name, d) for name, _ in chain)
            caps.update({(name, d): gbps for name, gbps in chain})
    for link in topo.nvlinks:  # one link both ways, as activations and peer swaps use it
        caps[(f"nvlink {min(link.a, link.b)}-{max(link.a, link.b)}", "p2p")] = link.gbps
    return caps, paths


def simulate(
    stages: list[SimStage],
    num_gpus: int,
    microbatches: int,
    topology: Topology | None = None,
    ssd: SsdLink | None = None,
    memory_bytes: int | None = None,
    host_cores: float | None = None,
    overhead_s: float = 0.0,
    delayed: bool = False,
) -> SimResult:
    """Event times of one step (see the module docstring); with a topology, loads and offloads share links;
    with an SsdLink, the updates of stages with SSD bytes stream them; with memory_bytes, loads prefetch only
    what fits (partial prefetch); with host_cores, the computations share that many cores; overhead_s, the
    loop's seconds outside the schedule, is added to the step time. delayed (the delayed update): the host updates are
    the step before's, run from the step's start one after the other, so the step is max(pipeline, updates).

    Raises ValueError for stages with SSD bytes but no SsdLink, RuntimeError if the schedule cannot make
    progress (a stage on a gpu that does not exist: a bug).
    """
    if ssd is None and any(
        s.ssd_read_bytes or s.ssd_write_bytes or s.ssd_loads or s.swap_tier == "ssd" for s in stages
    ):
        raise ValueError("stages move bytes to or from the SSD but simulate() got no ssd=SsdLink(...)")
    if host_cores is not None and not host_cores > 0:
        raise ValueError(f"host_cores must be > 0 (the cores the computations share), found {host_cores}")
    if not overhead_s >= 0:
        raise ValueError(f"overhead_s must be >= 0 (the loop's seconds per step), found {overhead_s}")
    caps: dict[Link, float] = {}
    if topology is not None:
        _check_bytes(stages, topology, num_gpus)
        caps, paths = link_paths(topology)
        if ssd is not None:
            caps |= {SSD_READ: ssd.read_gbps, SSD_WRITE: ssd.write_gbps}
    else:
        paths = {(g, d): ((f"gpu{g}", d),) for g in range(num_gpus) for d in ("h2d", "d2h")}
    if host_cores is not None:
        caps |= {HOST_CORES: host_cores} | {(f"gpu{g}", "compute"): 1.0 for g in range(num_gpus)}
    graph = TaskGraph(FlowNet(caps)) if caps else TaskGraph()
    moves: list[tuple[int, tuple[Link, ...]]] = []
    spans: dict[int, list[tuple[Hashable, Hashable, str]]] = {}
    nvlinks = frozenset(
        (a, b) for a in range(num_gpus) for b in range(a + 1, num_gpus) if topology and topology.nvlink(a, b)
    )
    for g in range(num_gpus):
        flows, cores = topology is not None, host_cores is not None
        swaps = Swaps(graph, microbatches, paths, flows, moves, nvlinks)
        spans[g] = _add_gpu(graph, stages, g, microbatches, paths, flows, moves, ssd, memory_bytes, cores, swaps)
    for j in range(len(stages) - 1):
        for i in range(microbatches):
            graph.add(("arrive", "F", j + 1, i), [_sent(graph, "F", j, i)], stages[j].comm_s)
            graph.add(("arrive", "B", j, i), [_sent(graph, "B", j + 1, i)], stages[j].comm_s)
    tasks = graph.run()
    events = _events(tasks, stages)
    offloads = [e for e in events if e[0] == "offload"]
    events += _host_updates([(*e[:5], 0.0) for e in offloads] if delayed else offloads, stages, ssd)
    busy = tuple(sum(e[5] - e[4] for e in events if e[1] == g and e[0] in ("F", "B")) for g in range(num_gpus))
    if topology is not None:
        moves += _activation_moves(stages, microbatches, topology, paths)
    slot = {"weights": max((s.param_bytes for s in stages), default=0)}
    slot["grads"] = max((s.grad_bytes for s in stages), default=0)  # the arena's gradient slot
    ssd_rows = _ssd_traffic(stages, moves)
    drive_s = ssd.seconds(ssd_rows[0][2], ssd_rows[1][2]) if ssd and ssd_rows else 0.0
    return SimResult(
        step_time_s=max(max((e[5] for e in events), default=0.0), drive_s) + overhead_s,
        compute_busy_s=busy,
        events=tuple(events),
        link_bytes=_traffic(moves, topology, num_gpus) + ssd_rows,
        peak_arena_bytes=tuple(_peak(tasks, spans[g], slot) for g in range(num_gpus)),
        activation_bytes=tuple(
            max((s.activation_bytes for s in stages if s.gpu == g), default=0) for g in range(num_gpus)
        ),
        stage_bytes=tuple((s.param_bytes, s.grad_bytes) for s in stages),
        link_model="static" if topology is None else f"flows:{topology.name}",
    )


def _check_bytes(stages: list[SimStage], topology: Topology, num_gpus: int) -> None:
    if topology.num_gpus != num_gpus:
        raise ValueError(f"topology {topology.name!r} has {topology.num_gpus} gpus, the simulation {num_gpus}")
    for j, s in enumerate(stages):
        if (s.param_bytes <= 0 < s.load_s) or (s.grad_bytes <= 0 < s.offload_s):
            raise ValueError(
                f"stage {j} has load_s {s.load_s} / offload_s {s.offload_s} but param_bytes "
                f"{s.param_bytes} / grad_bytes {s.grad_bytes}: with a topology the simulator times "
                f"transfers from their bytes; build stages with partition.search.sim_stages"
            )


def _add_gpu(
    graph: TaskGraph,
    stages: list[SimStage],
    g: int,
    m: int,
    paths: dict,
    flows: bool,
    moves: list,
    ssd,
    memory,
    cores: bool = False,
    swaps: Swaps | None = None,
) -> list[tuple[Hashable, Hashable, str]]:
    """Gpu g's loads, computations and offloads, chained as the runtime orders them; returns its arena spans
    (task whose start takes a slot, task whose end frees it, "weights" or "grads"). Loads of ssd_loads stages and
    offloads of ssd_weights stages cross the SSD; with cores, computations are core-second flows on HOST_CORES and
    the gpu's own compute link."""
    visits, last = visits_of([s.gpu for s in stages], g), len(stages) - 1
    prev_op = prev_load = prev_off = load = None
    slot_of: list[int] = []
    holder: list[Hashable] = [None] * WEIGHT_SLOTS  # last computation of the visit that used each weight slot
    taken: list[Hashable] = [None] * WEIGHT_SLOTS  # the load that took each weight slot
    spans: list[tuple[Hashable, Hashable, str]] = []
    for k, (j, phase) in enumerate(visits):
        st = stages[j]
        if k > 0 and visits[k - 1][0] == j:  # the last forward stage stays resident for its backward
            slot_of.append(slot_of[-1])
        else:
            slot = (slot_of[-1] + 1) % WEIGHT_SLOTS if slot_of else 0
            slot_of.append(slot)
            share = _prefetch_share(stages, visits, k, memory)
            load = taken[slot] = _load(graph, (g, j, k), st, share, (prev_load, holder[slot]), paths, flows, moves, ssd)
            if share < 1.0:
                load = _load(graph, (g, j, k, "rest"), st, 1.0 - share, (load, prev_op), paths, flows, moves, ssd)
            prev_load = load
        first = None
        for i in range(0 if phase == "F" and st.fused else m):  # a fused stage's F visit runs nothing
            wait = _awaited(stages, j, i, phase, last)
            if wait and (recv := _recv_s(stages, j, wait[1], g)):
                wait = graph.add(("recv", phase, j, i), (prev_op, wait), *_on_thread(recv, g, cores))
            dur = st.f_s if phase == "F" else st.b_s
            deps = (load, prev_op, wait, prev_off if phase == "B" else None)
            deps += tuple(swaps.before(st, j, i, phase, prev_op)) if swaps else ()
            prev_op = graph.add((phase, j, i), deps, *_on_thread(dur, g, cores))
            if swaps:
                swaps.after(st, j, i, phase, prev_op)
            first = first or (phase, j, i)
            if send := _send_s(stages, j, phase, g):
                prev_op = graph.add(("send", phase, j, i), (prev_op,), *_on_thread(send, g, cores))
        holder[slot_of[k]] = prev_op
        if not (k + 1 < len(visits) and visits[k + 1][0] == j):
            spans.append((taken[slot_of[k]], prev_op, "weights"))  # RELEASE
        if phase == "B":
            move = (st.grad_bytes if st.offloads else 0, paths[(g, "d2h")] + ((SSD_WRITE,) if st.ssd_weights else ()))
            moves.append(move)
            dur = max(st.offload_s, ssd.seconds(0, st.grad_bytes)) if st.ssd_weights else st.offload_s
            prev_off = graph.add(("offload", g, j), (prev_op, prev_off), dur, (move,) if flows and st.offloads else ())
            spans.append((first, prev_off, "grads"))  # the gradient slot
    return spans


def _awaited(stages: list[SimStage], j: int, i: int, phase: str, last: int) -> tuple[str, str, int, int] | None:
    """The message (j, i) in `phase` waits for: the forward's input, the backward's output gradient; the last stage's
    backward, fused, waits for its input (none for stage 0's forward, nor for the unfused last stage's backward)."""
    if phase == "B" and j == last:
        return ("arrive", "F", j, i) if stages[j].fused and j > 0 else None
    return None if phase == "F" and j == 0 else ("arrive", phase, j, i)


def _on_thread(seconds: float, g: int, cores: bool) -> tuple[float, tuple]:
    """A task's (dur, flows) on gpu g's compute stream: `seconds` of one core shared on HOST_CORES with cores,
    else a fixed duration."""
    return (0.0, ((seconds * 1e9, (HOST_CORES, (f"gpu{g}", "compute"))),)) if cores else (seconds, ())


def _sent(graph: TaskGraph, phase: str, j: int, i: int) -> Hashable:
    """The task after which (phase, j, i)'s message leaves: its send where the sender posts one, else itself."""
    return ("send", phase, j, i) if ("send", phase, j, i) in graph.tasks else (phase, j, i)


def _send_s(stages: list[SimStage], j: int, phase: str, g: int) -> float:
    """Seconds gpu g's compute stream spends after F(j, i) or B(j, i) posting its message to another gpu."""
    to = j + 1 if phase == "F" else j - 1
    far = 0 <= to < len(stages) and stages[to].gpu != g and not (phase == "F" and stages[j].fused)
    return stages[j].send_s if far else 0.0


def _recv_s(stages: list[SimStage], j: int, phase: str, g: int) -> float:
    """Seconds gpu g's compute stream spends before F(j, i) or B(j, i) taking its message from another gpu."""
    frm = j - 1 if phase == "F" else j + 1
    return stages[j].recv_s if 0 <= frm < len(stages) and stages[frm].gpu != g else 0.0


def _prefetch_share(stages: list[SimStage], visits: list, k: int, memory: int | None) -> float:
    """The fraction of visit k's weights its gpu can load while visit k-1 computes (1 without a memory)."""
    st = stages[visits[k][0]]
    if memory is None or k == 0 or st.param_bytes <= 0:
        return 1.0
    j, phase = visits[k - 1]
    p = stages[j]
    used = p.param_bytes + p.activation_bytes + (p.grad_bytes if phase == "B" else 0)
    return min(1.0, max(0.0, (memory - used) / st.param_bytes))


def _load(graph: TaskGraph, key: tuple, st: SimStage, share: float, deps, paths, flows, moves, ssd) -> Hashable:
    """A load of `share` of stage st's weights onto gpu key[0] after deps; its bytes join `moves`."""
    nbytes = round(st.param_bytes * share)
    move = (nbytes, paths[(key[0], "h2d")] + ((SSD_READ,) if st.ssd_loads else ()))
    moves.append(move)
    dur = st.load_s * share
    if st.ssd_loads:
        dur = max(dur, ssd.seconds(nbytes, 0))
    return graph.add(("load", *key), deps, dur, (move,) if flows else ())


def _events(tasks: dict, stages: list[SimStage]) -> list[tuple[str, int, int, int, float, float]]:
    out = []
    for key, t in tasks.items():
        if key[0] in ("F", "B"):
            out.append((key[0], stages[key[1]].gpu, key[1], key[2], t.start, t.end))
        elif key[0] in ("load", "offload"):
            out.append((key[0], key[1], key[2], -1, t.start, t.end))
    order = {"load": 0, "F": 1, "B": 2, "offload": 3}
    return sorted(out, key=lambda e: (e[4], e[1], order[e[0]], e[2], e[3]))


def update_seconds(stage: SimStage, ssd: SsdLink | None) -> float:
    """How long stage j's update takes: its Adam, or its SSD traffic streamed under it when that is longer."""
    if ssd is None or not (stage.ssd_read_bytes or stage.ssd_write_bytes):
        return stage.update_s
    return max(stage.update_s, ssd.seconds(stage.ssd_read_bytes, stage.ssd_write_bytes))


def _host_updates(offloads: list, stages: list[SimStage], ssd: SsdLink | None) -> list:
    """Each gpu's updates one at a time on its rank's thread, in the order their gradients arrived; an update that
    streams states through the SSD also waits for the drive (the legend)."""
    free: dict[int, float] = {}
    drive, out = 0.0, []
    for _, g, j, _, _start, stop in sorted(offloads, key=lambda e: (e[5], e[4], e[1], e[2])):
        streams = ssd is not None and (stages[j].ssd_read_bytes > 0 or stages[j].ssd_write_bytes > 0)
        t0 = max(free.get(g, 0.0), stop, drive if streams else 0.0)
        free[g] = t0 + update_seconds(stages[j], ssd)
        if streams:
            assert ssd is not None
            drive = t0 + ssd.seconds(stages[j].ssd_read_bytes, stages[j].ssd_write_bytes)
        out.append(("update", g, j, -1, t0, free[g]))
    return out


def _peak(tasks: dict, spans: list[tuple[Hashable, Hashable, str]], size: dict[str, int]) -> int:
    """Most bytes of the spans open at once (a span of kind k holds size[k]); a span ending at t frees its slot
    before one starting at t takes it."""
    ends = [(tasks[b].end, -size[k]) for _, b, k in spans]
    marks = sorted([(tasks[a].start, size[k]) for a, _, k in spans] + ends)
    best = cur = 0
    for _, d in marks:
        cur += d
        best = max(best, cur)
    return best


def _activation_moves(stages: list[SimStage], m: int, topo: Topology, paths: dict) -> list:
    """Bytes of activations (forward) and their gradients (backward) between gpus: NVLink, else the sender's
    path up and the receiver's path down (through host memory; PCIe P2P is counted the same way)."""
    out = []
    for j in range(len(stages) - 1):
        a, b, n = stages[j].gpu, stages[j + 1].gpu, stages[j].output_bytes * m
        if a == b or n == 0:
            continue
        if topo.nvlink(a, b):
            out.append((2 * n, ((f"nvlink {min(a, b)}-{max(a, b)}", "p2p"),)))
        else:
            out += [(n, paths[(a, "d2h")] + paths[(b, "h2d")]), (n, paths[(b, "d2h")] + paths[(a, "h2d")])]
    return out


def _ssd_traffic(stages: list[SimStage], moves: list) -> tuple[tuple[str, str, int], ...]:
    """("ssd", "read"/"write", bytes) of the updates, loads and offloads when any moves bytes to or from the
    SSD, else nothing."""
    read = sum(s.ssd_read_bytes for s in stages) + sum(n for n, path in moves if SSD_READ in path)
    write = sum(s.ssd_write_bytes for s in stages) + sum(n for n, path in moves if SSD_WRITE in path)
    return (("ssd", "read", read), ("ssd", "write", write)) if read or write else ()


def _traffic(moves: list, topo: Topology | None, num_gpus: int) -> tuple[tuple[str, str, int], ...]:
    """Bytes per link: every gpu link, then switch and root complex uplinks, then NVLinks, each h2d then d2h."""
    total: Counter = Counter()
    for nbytes, path in moves:
        for link in path:
            total[link] += nbytes
    names = [f"gpu{g}" for g in range(num_gpus)]
    if topo is not None:
        names += [s.name for s in topo.switches] + [r.name for r in topo.root_complexes]
    links = [(n, d) for n in names for d in ("h2d", "d2h")]
    links += sorted(k for k in total if k[1] == "p2p")
    return tuple((n, d, int(total[(n, d)])) for n, d in links)
