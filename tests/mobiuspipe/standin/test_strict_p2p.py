"""NCCL's point-to-point rules on the CPU stand-in (MOBIUSPIPE_STRICT=1): a send waits for its receive, a pair's
operations run in post order on one queue per communicator, and the schedule checker models the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mobiuspipe.schedule import ScheduleError, build_schedule, check_schedules
from partition.rules.mapping import round_robin

WORKER = Path(__file__).parents[1] / "p2p_worker.py"


def _two_ranks(tmp_path, scenario: str, strict: str) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {"MOBIUSPIPE_STRICT": strict, "PYTHONPATH": os.pathsep.join([str(WORKER.parent), *sys.path])}
    proc = subprocess.run(
        [*cmd, str(WORKER), scenario, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,strict,want", [("pair", "0", "ok"), ("pair", "1", "timeout"), ("direction", "1", "ok")]
)
def test_both_send_first(tmp_path, layout, strict, want):
    """gloo lets two crossing sends through; NCCL (and the strict stand-in) hangs them on one communicator, and
    one communicator per direction does not."""
    assert _two_ranks(tmp_path, layout, strict) == [want, want]


@pytest.mark.slow
def test_a_hang_among_live_ranks_ends_at_the_hang_timeout(tmp_path):
    """Both ranks live (their beats go on), so comm_timeout_s (1 s) finds nobody lost; the wait ends at the channels'
    deadline, hang_timeout_s (4 s), naming the peer and the message."""
    for result in _two_ranks(tmp_path, "hang", "1"):
        assert result.startswith("after ") and "receiving a message never sent from rank" in result, result
        assert "the ranks wait on each other (a hang, which runtime.hang_timeout_s ends)" in result
        assert 3.5 <= float(result.split()[1]) < 20, result


@pytest.mark.slow
@pytest.mark.parametrize("strict", ["1", "0"])
def test_a_peer_lost_before_the_warm_up_is_named(tmp_path, strict):
    """Rank 1 stops beating before the channels' warm-up (as a rank stopped there would): rank 0's warm-up message
    waits for it under the watch and fails once rank 1 has been silent for comm_timeout_s (1.5 s), naming it, not at
    the channels' deadline (60 s); on the strict stand-in and on gloo's own waits (the lax one)."""
    rank0, rank1 = _two_ranks(tmp_path, "warm_up_lost", strict)
    assert rank1 == "stopped"
    assert rank0.startswith("after ") and "rank 1 has given no sign of life" in rank0, rank0
    assert float(rank0.split()[1]) < 1.5 + 5, rank0


@pytest.mark.slow
def test_the_calls_after_the_watchs_abort_name_the_lost_peer(tmp_path):
    """On NCCL the watch aborts every group once a peer is lost (torch's _abort_process_group unregisters them too),
    and the rank's host goes on past the aborted kernels to its next message or reduction: each names the lost rank
    (PeerLostError), not torch's "group is not registered"."""
    rank0, rank1 = _two_ranks(tmp_path, "after_abort", "0")
    assert rank1 == "stopped" and len(rank0) == 2  # a send, then a reduction
    for outcome in rank0:
        assert outcome.startswith("PeerLostError: ") and "rank 1 has given no sign of life" in outcome, outcome


@pytest.mark.slow
def test_a_receive_paired_with_the_wrong_send_is_an_error(tmp_path):
    rank0, rank1 = _two_ranks(tmp_path, "order", "1")
    assert rank0.startswith("error:") and "pairs the sends and receives of a pair by order" in rank0
    assert rank1 in ("timeout",) or rank1.startswith("error:")


@pytest.mark.parametrize("stages,gpus,m", [(4, 2, 2), (4, 2, 3), (6, 2, 3), (5, 2, 3)])
def test_the_checker_finds_the_shared_queue_deadlock(stages, gpus, m):
    """Mapping [0,1,0,1,...]: rank 0 sends stage 0's microbatches while rank 1 sends stage 1's first output back;
    each send waits for a receive queued behind the other's send."""
    mapping = round_robin(stages, gpus)
    scheds = [build_schedule(mapping, g, m) for g in range(gpus)]
    with pytest.raises(ScheduleError, match=r"deadlock under NCCL's rules \(channels 'pair'\): gpu 0 waits at RA2.0"):
        check_schedules(mapping, m, scheds, channels="pair")
    check_schedules(mapping, m, scheds, channels="direction")


def test_a_deadlock_names_each_rank_and_its_queue_heads():
    mapping = [0, 1, 0, 1]
    scheds = [build_schedule(mapping, g, 2) for g in range(2)]
    with pytest.raises(ScheduleError) as e:
        check_schedules(mapping, 2, scheds, channels="pair")
    text = str(e.value)
    assert "gpu 0 waits at RA2.0, its queues start with [send SA0.1 to gpu 1]" in text
    assert "gpu 1 waits at RA1.1, its queues start with [send SA1.0 to gpu 0]" in text
