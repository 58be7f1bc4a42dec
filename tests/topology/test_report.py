"""Reports: the `topology --json` contract, the lstopo-style tree, the nvidia-smi style matrix and the SVG picture."""

import json
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest

from topology import PRESETS, cpu_standin, preset
from topology.layout import topology_from_dict
from topology.presets import PCIE3_X16_GBPS
from topology.report import LEGEND, P2P_LEGEND, render_matrix, render_text, render_tree, to_json_dict
from topology.report_svg import svg_text, svg_topology
from topology.types import Measured, NvLink, Nvme, RootComplex, Switch

SVG = "{http://www.w3.org/2000/svg}"


def _full():
    """2+2 with a nested switch, NVMe drives, NVLinks, P2P statuses, measurements, notes and an empty root complex."""
    t = preset("2+2")
    return replace(
        t,
        name="full",
        host_memory_bytes=512 * 2**30,
        notes=("no NVML: names from sysfs",),
        root_complexes=t.root_complexes + (RootComplex("rc2", 0, 7.88),),
        switches=t.switches + (Switch("sw0b", "rc0", 7.88, parent="sw0"),),
        nvme=(
            Nvme("nvme0", "0000:3d:00.0", "rc0", 0, 7.88, switch="sw0b", model="Samsung SSD 980 PRO"),
            Nvme("nvme1", "0000:5e:00.0", "rc2", 0, 3.94),
        ),
        nvlinks=(NvLink(0, 1, 4, 56.25), NvLink(1, 2, 2, 28.125)),
        p2p=tuple(tuple("X" if a == b else "OK" if {a, b} == {0, 1} else "GNS" for b in range(4)) for a in range(4)),
        measured=Measured(
            h2d_gbps=(12.0, 12.5, 11.5, 13.0),
            h2d_group_gbps=(6.0, 6.5, 5.5, 6.0),
            d2d_gbps=tuple(tuple(0.0 if a == b else 9.5 for b in range(4)) for a in range(4)),
            ssd_dir="/scratch",
            ssd_read_gbps=3.2,
            ssd_write_gbps=2.1,
            notes=("p2p not measured",),
        ),
    )


ALL = [*PRESETS.values(), cpu_standin(1, 512 * 2**20), cpu_standin(3, 2**30), _full()]
IDS = [t.name for t in ALL]

MATRICES = {  # hand-written nvidia-smi topo -m cells, row by row
    "2+2": ["X PIX SYS SYS", "PIX X SYS SYS", "SYS SYS X PIX", "SYS SYS PIX X"],
    "3+1": ["X PIX PIX SYS", "PIX X PIX SYS", "PIX PIX X SYS", "SYS SYS SYS X"],
    "4": ["X PIX PHB PHB", "PIX X PHB PHB", "PHB PHB X PIX", "PHB PHB PIX X"],
    "8-dual-socket": [
        "X PIX PHB PHB SYS SYS SYS SYS",
        "PIX X PHB PHB SYS SYS SYS SYS",
        "PHB PHB X PIX SYS SYS SYS SYS",
        "PHB PHB PIX X SYS SYS SYS SYS",
        "SYS SYS SYS SYS X PIX PHB PHB",
        "SYS SYS SYS SYS PIX X PHB PHB",
        "SYS SYS SYS SYS PHB PHB X PIX",
        "SYS SYS SYS SYS PHB PHB PIX X",
    ],
    "2x2-nvlink": ["X NV4 SYS SYS", "NV4 X SYS SYS", "SYS SYS X NV4", "SYS SYS NV4 X"],
    "cpu-standin-3": ["X PHB PHB", "PHB X PHB", "PHB PHB X"],
    "full": ["X NV4 SYS SYS", "NV4 X NV2 SYS", "SYS NV2 X PIX", "SYS SYS PIX X"],
}


# ---- JSON -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", ALL, ids=IDS)
def test_json_contract_and_round_trip(t):
    d = to_json_dict(t)
    assert json.loads(json.dumps(d)) == d  # plain JSON as is, nothing lost
    assert d["source"] == t.source and d["contention_groups"] == t.contention_groups()
    assert [g["index"] for g in d["gpus"]] == list(range(t.num_gpus))
    for g in d["gpus"]:
        assert {"index", "name", "memory_bytes", "pci_bus_id", "root_complex", "numa_node"} <= set(g)
        assert g["load_gbps_alone"] == t.load_gbps(g["index"], 1)
    plain = t.to_dict()
    assert set(plain) | {"contention_groups", "matrix"} == set(d)
    for key, value in plain.items():
        if key != "gpus":
            assert d[key] == value, key
    assert [{k: g[k] for k in plain["gpus"][0]} for g in d["gpus"]] == plain["gpus"]
    assert d["matrix"] == [[t.level(a, b) for b in range(t.num_gpus)] for a in range(t.num_gpus)]
    if t.name in MATRICES:
        assert d["matrix"] == [row.split() for row in MATRICES[t.name]]


@pytest.mark.parametrize("t", ALL, ids=IDS)
def test_json_minus_report_keys_is_a_layout(t):
    d = json.loads(json.dumps(to_json_dict(t)))
    del d["contention_groups"], d["matrix"]
    for g in d["gpus"]:
        del g["load_gbps_alone"], g["load_gbps_group"]
    assert topology_from_dict(d, "topology.json") == t


def test_json_group_load_is_contended_by_the_whole_group():
    d = to_json_dict(preset("3+1"))
    assert [g["load_gbps_group"] for g in d["gpus"]] == pytest.approx([PCIE3_X16_GBPS / 3] * 3 + [PCIE3_X16_GBPS])
    assert [g["load_gbps_alone"] for g in d["gpus"]] == pytest.approx([PCIE3_X16_GBPS] * 4)
    assert to_json_dict(cpu_standin(4, 2**30))["gpus"][0]["load_gbps_group"] == 10.0  # CPU copies do not contend


# ---- tree -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", ALL, ids=IDS)
def test_tree_names_every_part(t):
    text = render_tree(t)
    lines = text.splitlines()
    assert lines[0].startswith(f"topology {t.name} ({t.source}): ")
    for g in t.gpus:
        line = next(x for x in lines if x.lstrip().startswith(f"gpu {g.index} "))
        assert g.name in line and g.pci_bus_id in line
    for part in [*t.root_complexes, *t.switches, *t.nvme]:
        assert any(x.lstrip().startswith(f"{part.name}  ") for x in lines), part.name
    groups = " ".join(str(g) for g in t.contention_groups())
    assert f"contention groups: {groups}  (gpus that share a root complex uplink)" in lines
    for note in t.notes:
        assert f"  - {note}" in lines


def test_tree_nests_socket_root_complex_switch_gpu():
    lines = render_tree(preset("2+2")).splitlines()
    assert lines[0] == "topology 2+2 (preset:2+2): 4 GPUs, 2 root complexes, 2 PCIe switches, no GPU peer-to-peer"
    assert lines[1:4] == [
        "socket 0 (NUMA node 0)",
        "  rc0  root complex  uplink 15.75 GB/s  shared by gpus 0, 1",
        "    sw0  PCIe switch  uplink 15.75 GB/s",
    ]
    assert lines[4] == (
        "      gpu 0  NVIDIA GeForce RTX 3090 Ti  24.0 GiB  0000:1a:00.0  gen3 x16 15.75 GB/s  "
        "h2d 15.75 GB/s alone, 7.88 with 2 copying"
    )
    assert lines[6] == "socket 1 (NUMA node 1)"
    assert lines[-1] == "host memory: unknown"


def test_tree_lone_gpu_and_cpu_standin():
    lines = render_tree(preset("3+1")).splitlines()
    gpu3 = next(x for x in lines if x.startswith("    gpu 3 "))  # directly on rc1's root port
    assert gpu3.endswith("h2d 15.75 GB/s alone")
    assert "  rc1  root complex  uplink 15.75 GB/s  shared by gpu 3" in lines
    text = render_tree(cpu_standin(1, 512 * 2**20))
    assert "1 GPU, 1 root complex, no GPU peer-to-peer" in text and "512.0 MiB  cpu:0  link 10.00 GB/s" in text


def test_tree_full_sections():
    text = render_tree(_full())
    assert "4 GPUs, 3 root complexes, 3 PCIe switches, 2 NVMe drives, GPU peer-to-peer on 2 pairs" in text
    assert "        nvme0  Samsung SSD 980 PRO  0000:3d:00.0  NVMe  7.88 GB/s" in text  # under sw0b under sw0
    assert "NVLink: gpu 0 <-> gpu 1  NV4  56.25 GB/s\nNVLink: gpu 1 <-> gpu 2  NV2  28.12 GB/s" in text
    assert "host memory: 512.0 GiB" in text
    assert "  host->gpu, alone                12.00  12.50  11.50  13.00" in text
    assert "  gpu0->                              -   9.50   9.50   9.50" in text
    assert "  ssd /scratch: read 3.20 GB/s, write 2.10 GB/s\n  note: p2p not measured" in text
    assert "  rc2  root complex  uplink 7.88 GB/s\n    nvme1  0000:5e:00.0" in text


# ---- matrix ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [t for t in ALL if t.name in MATRICES], ids=lambda t: t.name)
def test_matrix_levels(t):
    lines = render_matrix(t).splitlines()
    n = t.num_gpus
    assert lines[0].split() == [f"GPU{i}" for i in range(n)] + ["CPU", "Affinity", "NUMA", "Affinity"]
    cells = [line.split()[1 : n + 1] for line in lines[1 : n + 1]]
    assert cells == [row.split() for row in MATRICES[t.name]]
    assert [line.split()[0] for line in lines[1 : n + 1]] == [f"GPU{i}" for i in range(n)]
    assert [line.split()[-1] for line in lines[1 : n + 1]] == [str(g.numa_node) for g in t.gpus]


def test_matrix_layout_and_legend():
    text = render_matrix(preset("2+2"))
    lines = text.splitlines()
    assert lines[0] == "        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity"
    assert lines[1] == "GPU0     X      PIX     SYS     SYS     N/A             0"
    assert lines[5:8] == ["", "Legend:", ""]
    assert lines[8:] == [f"  {k:<4} = {v}" for k, v in LEGEND]
    sys_line = "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)"
    assert sys_line in lines
    assert "P2P" not in text  # no P2P statuses known


def test_matrix_cpu_affinity_and_p2p():
    t = preset("2x2-nvlink")
    gpus = tuple(replace(g, cpu_affinity="0-11,24-35" if g.numa_node == 0 else "12-23,36-47") for g in t.gpus)
    lines = render_matrix(replace(t, gpus=gpus)).splitlines()
    assert lines[1] == "GPU0     X      NV4     SYS     SYS     0-11,24-35      0"
    start = lines.index("P2P read status (nvidia-smi topo -p2p r):")
    assert lines[start + 1] == "        GPU0    GPU1    GPU2    GPU3"
    assert lines[start + 2] == "GPU0     X      OK      GNS     GNS"
    assert lines[start + 5] == "GPU3    GNS     GNS     OK       X"
    assert lines[-len(P2P_LEGEND) :] == [f"  {k:<4} = {v}" for k, v in P2P_LEGEND]


def test_text_is_tree_then_matrix():
    t = preset("8-dual-socket")
    assert render_text(t) == render_tree(t) + "\n" + render_matrix(t)


# ---- picture --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", ALL, ids=IDS)
def test_svg_parses_and_labels_every_part(tmp_path, t):
    path = svg_topology(t, tmp_path / "t.svg", title="box & <friends>")
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg" and float(root.attrib["width"]) > 0 and float(root.attrib["height"]) > 0
    texts = [e.text or "" for e in root.iter(f"{SVG}text")]
    assert "box & <friends>" in texts
    for g in t.gpus:
        assert f"GPU {g.index}" in texts
    for part in [*t.root_complexes, *t.switches]:
        assert any(x.startswith(f"{part.name} \u00b7 ") for x in texts), part.name
    for d in t.nvme:
        assert d.name in texts
    for link in t.nvlinks:
        assert f"NV{link.links} {link.gbps:.0f} GB/s" in texts
    for numa in {r.numa_node for r in t.root_complexes}:
        assert f"CPU socket {numa} \u00b7 NUMA node {numa}" in texts


def test_svg_footer_shows_alone_vs_group():
    texts = [e.text for e in ET.fromstring(svg_text(preset("3+1"))).iter(f"{SVG}text")]
    assert "15.75 GB/s alone, 5.25 GB/s while all 3 copy" in texts
    assert "15.75 GB/s alone, no other GPU shares its uplink" in texts
    assert "GPUs 0-2 (rc0)" in texts and "GPU 3 (rc1)" in texts
    assert "topology 3+1" in texts  # the default title


def test_svg_groups_have_distinct_colours():
    root = ET.fromstring(svg_text(preset("2+2")))
    fills = {r.get("fill") for r in root.iter(f"{SVG}rect")}
    assert {"#1a73e8", "#e8710a"} <= fills  # the GPUs of rc0 and of rc1


def test_svg_unwritable_path(tmp_path):
    from topology import TopologyError

    with pytest.raises(TopologyError, match=r"no/such/t\.svg: cannot write the topology picture"):
        svg_topology(preset("2+2"), tmp_path / "no" / "such" / "t.svg")
