"""Helpers of the simulator's tests: stages of hand-set times and bytes, the events of a result, a box of
root complexes and switches, and the invariants every simulated step keeps."""

from partition.sim.simulate import SimStage
from topology.types import Gpu, RootComplex, Switch, Topology


def _st(gpu, fwd, bwd, load, offload, update, comm):
    return SimStage(gpu=gpu, fwd_s=fwd, bwd_s=bwd, load_s=load, offload_s=offload, update_s=update, comm_s=comm)


def _ev(res, kind, j, i=-1):
    """(start, end) of the single event of `kind` for stage j, microbatch i."""
    hits = [(e[4], e[5]) for e in res.events if e[0] == kind and e[2] == j and e[3] == i]
    assert len(hits) == 1, (kind, j, i, hits)
    return hits[0]


def _loads(res, j):
    return [(e[4], e[5]) for e in res.events if e[0] == "load" and e[2] == j]


def _random_stages(rng, num_gpus, mapping):
    def q():
        return float(rng.integers(1, 16)) / 4  # dyadic

    return [_st(g, q(), q(), q(), q() / 2, q() / 4, q() / 2) for g in mapping]


def _check_invariants(res, stages, n, m):
    S = len(stages)
    ev = {}
    for e in res.events:
        ev.setdefault((e[0], e[2], e[3]), []).append(e)
        assert e[4] <= e[5]
    for j, st in enumerate(stages):
        for i in range(m):
            (f,), (b,) = ev[("F", j, i)], ev[("B", j, i)]
            assert f[1] == b[1] == st.gpu
            assert f[5] - f[4] == st.fwd_s and b[5] - b[4] == st.fwd_s + st.bwd_s
            if j > 0:
                assert f[4] >= ev[("F", j - 1, i)][0][5] + stages[j - 1].comm_s
            if j < S - 1:
                assert b[4] >= ev[("B", j + 1, i)][0][5] + st.comm_s
        (off,), (upd,) = ev[("offload", j, -1)], ev[("update", j, -1)]
        assert off[4] >= ev[("B", j, m - 1)][0][5] and upd[4] >= off[5]
    for g in range(n):
        mine = [j for j in range(S) if stages[j].gpu == g]
        if not mine:
            continue
        # one load per visit, except the gpu's last forward stage, which stays for its backward
        for j in mine:
            assert len(ev[("load", j, -1)]) == (1 if j == mine[-1] else 2), (g, j, mine)
        for kind in ("load", "compute", "offload"):
            kinds = ("F", "B") if kind == "compute" else (kind,)
            spans = sorted((e[4], e[5]) for e in res.events if e[1] == g and e[0] in kinds)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), (g, kind)  # one engine each
        busy = sum(m * (2 * stages[j].fwd_s + stages[j].bwd_s) for j in mine)
        assert res.compute_busy_s[g] == busy
    for g in range(n):  # each rank runs one Adam at a time
        upd = sorted((e[4], e[5]) for e in res.events if e[0] == "update" and e[1] == g)
        assert all(a[1] <= b[0] for a, b in zip(upd, upd[1:])), g
    assert res.step_time_s == max(e[5] for e in res.events)


def _box(rcs, link=16.0, switches=()):
    """gpus per root complex: rcs = {"rc0": (uplink GB/s, [gpu, ...])}; switches = (name, rc, GB/s, [gpus])."""
    on_switch = {g: name for name, _, _, gs in switches for g in gs}
    gpus = sorted((g, rc) for rc, (_, gs) in rcs.items() for g in gs)
    roots = tuple(RootComplex(r, 0, up) for r, (up, _) in rcs.items())
    return Topology(
        name="box",
        source="test",
        root_complexes=roots,
        switches=tuple(Switch(n, rc, up) for n, rc, up, _ in switches),
        gpus=tuple(
            Gpu(
                index=g,
                name="t",
                memory_bytes=2**30,
                pci_bus_id=f"0000:{g:02x}:00.0",
                root_complex=rc,
                numa_node=0,
                link_gbps=link,
                switch=on_switch.get(g, ""),
            )
            for g, rc in gpus
        ),
    )


def _fst(gpu, param, grad=0, fwd=1.0, bwd=1.0, load=0.0, offload=0.0, act=0, out=0):
    return SimStage(
        gpu=gpu,
        fwd_s=fwd,
        bwd_s=bwd,
        load_s=load,
        offload_s=offload,
        update_s=0.0,
        comm_s=0.0,
        param_bytes=param,
        grad_bytes=grad,
        activation_bytes=act,
        output_bytes=out,
    )


def _bytes(res):
    return {(n, d): b for n, d, b in res.link_bytes}
