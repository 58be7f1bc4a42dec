"""Every mistake a user can fix is a UserError, which the CLI and the torchrun entry print as one line, exit 2."""

import contextlib
import io

import pytest

from foundation.errors import UserError
from mobiuspipe import cli
from mobiuspipe.cli._common import CliError
from mobiuspipe.errors import (
    ArenaError,
    ConfigError,
    PeerLostError,
    PipelineError,
    StartUpError,
    SwapIOError,
    WorldSizeError,
)
from partition.errors import PlanFileError, PlanInfeasibleError, ProfileFileError, UnknownModelError
from partition.spec.hf import ModelConfigError
from topology.errors import TopologyError

USER_FIXABLE = [
    ConfigError,
    ArenaError,
    PeerLostError,
    WorldSizeError,
    SwapIOError,
    TopologyError,
    PlanInfeasibleError,
    UnknownModelError,
    PlanFileError,
    ProfileFileError,
    ModelConfigError,
    CliError,
    PipelineError,
    StartUpError,
]
OTHER_BASES = {
    ConfigError: ValueError,
    ArenaError: RuntimeError,
    PeerLostError: RuntimeError,
    WorldSizeError: RuntimeError,
    SwapIOError: RuntimeError,
    TopologyError: ValueError,
    PlanInfeasibleError: ValueError,
    UnknownModelError: KeyError,
    PlanFileError: ValueError,
    ProfileFileError: ValueError,
    ModelConfigError: ValueError,
    CliError: ValueError,
    PipelineError: ValueError,
    StartUpError: RuntimeError,
}


@pytest.mark.parametrize("error", USER_FIXABLE, ids=lambda e: e.__name__)
def test_user_fixable_errors_are_user_errors_and_keep_their_bases(error):
    assert issubclass(error, UserError) and issubclass(error, OTHER_BASES[error])


def _main(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(argv)
    return code, err.getvalue()


def test_cli_prints_a_user_error_as_one_line_and_exits_2(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lrr: 1\n  steps: 0\nplan:\n  num_gpus: 0\n  num_gpus: 1\n")
    code, err = _main(["train", "--config", str(path)])
    assert code == 2 and err.count("\n") == 1 and err.startswith("mobiuspipe: error: config ")
    path.write_text("train:\n  lrr: 1\n  steps: 0\n")
    code, err = _main(["train", "--config", str(path)])
    assert code == 2 and err.count("\n") == 1 and "2 errors: (1) train.lrr" in err and "(2) train.steps" in err


def test_cli_keeps_the_traceback_of_a_bug(monkeypatch):
    def broken(args, out):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli.env, "run", broken)
    with pytest.raises(ZeroDivisionError):
        _main(["env"])


def test_torchrun_entry_prints_a_user_error_as_one_line_and_exits_2(tmp_path, capfd):
    from mobiuspipe import train

    path = tmp_path / "run.yaml"
    path.write_text("model:\n  d_model: 66\ndata:\n  batch_size: 0\n")
    assert train.main(["--config", str(path)]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mobiuspipe.train: error: config ") and "2 errors" in err
