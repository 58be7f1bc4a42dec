"""Profile files (YAML and JSON round trips, clear errors) and layer-similarity compression."""

import json
from dataclasses import replace

import pytest
import yaml

from partition.spec.analytic import analytic_profile
from partition.spec.hardware import device_spec
from partition.spec.models import MODELS, ModelSpec
from partition.spec.profile import Profile, ProfileFileError, compress, expand, load_profile, runs_to_list, save_profile

TI = device_spec("RTX 3090 Ti")
SMALL = ModelSpec("small", num_blocks=5, d_model=64, num_heads=4, seq_len=32, vocab_size=97)


@pytest.fixture
def prof() -> Profile:
    return analytic_profile(SMALL, TI, microbatch_size=3)


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_round_trip_is_exact(tmp_path, prof, suffix):
    path = tmp_path / f"p{suffix}"
    save_profile(prof, path)
    assert load_profile(path) == prof
    assert (json.loads if suffix == ".json" else yaml.safe_load)(path.read_text()) == prof.to_dict()


def test_round_trip_of_awkward_floats(tmp_path, prof):
    layers = list(prof.layers)
    layers[1] = replace(layers[1], fwd_s=1e-05, bwd_s=1 / 3, fwd_flops=1.2345678901234567e20)
    odd = replace(prof, layers=tuple(layers))
    for name in ("o.yaml", "o.json"):
        save_profile(odd, tmp_path / name)
        assert load_profile(tmp_path / name) == odd


def test_compress_and_expand(prof):
    runs = compress(prof)
    assert [(x.name, n) for x, n in runs] == [("embedding", 1), ("block", 5), ("head", 1)]
    assert expand(runs) == prof.layers
    assert compress(prof.layers) == runs
    assert compress([]) == [] and expand([]) == ()


def test_compress_keeps_order_and_separates_unequal_neighbours(prof):
    e, b, h = prof.layers[0], prof.layers[1], prof.layers[-1]
    b2 = replace(b, fwd_s=b.fwd_s * 2)
    layers = (e, b, b, b2, b, h, h)
    assert [n for _, n in compress(layers)] == [1, 2, 1, 1, 2]
    assert expand(compress(layers)) == layers


def test_gpt3_175b_compresses_to_three_runs():
    p = analytic_profile(MODELS["gpt3-175b"], TI)
    assert [n for _, n in compress(p)] == [1, 96, 1]


@pytest.mark.parametrize("count", [0, -1, 1.5, True])
def test_expand_rejects_bad_counts(prof, count):
    with pytest.raises(ValueError, match="count"):
        expand([(prof.layers[0], count)])


def test_runs_alone_stand_in_for_layers(tmp_path, prof):
    d = {k: v for k, v in prof.to_dict().items() if k != "layers"}
    d["runs"] = runs_to_list(prof)
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(d))
    assert load_profile(path) == prof
    both = {**prof.to_dict(), "runs": runs_to_list(prof)}  # what `profile --json` prints
    path.write_text(json.dumps(both))
    assert load_profile(path) == prof


def _write(tmp_path, d, name="bad.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(d))
    return path


@pytest.mark.parametrize(
    "edit,needles",
    [
        (lambda d: d.pop("dtype"), ["dtype: expected a string (a required key), found nothing"]),
        (lambda d: d.update(colour="red"), ["unknown key 'colour'", "microbatch_size"]),
        (lambda d: d.update(microbatch_size=0), ["microbatch_size: expected an integer >= 1, found integer 0"]),
        (lambda d: d.update(seq_len="32"), ["seq_len: expected an integer, found string '32'"]),
        (lambda d: d.update(layers=[]), ["layers: expected a non-empty list"]),
        (lambda d: d.pop("layers"), ["layers: expected a list of mappings (a required key), found nothing"]),
        (lambda d: d["layers"][2].update(fwd_s="fast"), ["layers[2].fwd_s: expected a number", "'fast'"]),
        (lambda d: d["layers"][1].update(param_bytes=-4), ["layers[1].param_bytes: expected an integer >= 0"]),
        (lambda d: d["layers"][1].update(param_count=True), ["layers[1].param_count: expected an integer"]),
        (
            lambda d: d["layers"][0].pop("output_bytes"),
            ["layers[0].output_bytes: expected an integer (a required key)"],
        ),
        (lambda d: d["layers"].__setitem__(3, [1, 2]), ["layers[3]: expected a mapping"]),
        (lambda d: d["layers"][0].update(bwd_s=float("nan")), ["layers[0].bwd_s: expected a finite number >= 0"]),
    ],
)
def test_malformed_files_name_file_and_key(tmp_path, prof, edit, needles):
    d = prof.to_dict()
    edit(d)
    path = _write(tmp_path, d)
    with pytest.raises(ProfileFileError) as err:
        load_profile(path)
    msg = str(err.value)
    assert str(path) in msg
    for needle in needles:
        assert needle in msg


def test_runs_that_disagree_with_layers(tmp_path, prof):
    d = {**prof.to_dict(), "runs": runs_to_list(prof)}
    d["runs"][1]["count"] = 4
    with pytest.raises(ProfileFileError, match="disagree"):
        load_profile(_write(tmp_path, d))
    d["runs"][1]["count"] = 0
    with pytest.raises(ProfileFileError, match=r"runs\[1\]\.count: expected an integer >= 1, found integer 0"):
        load_profile(_write(tmp_path, d))


def test_unreadable_and_unparsable_files(tmp_path):
    with pytest.raises(ProfileFileError, match=r"profile .*none\.yaml: file not found"):
        load_profile(tmp_path / "none.yaml")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ProfileFileError, match="expected valid JSON"):
        load_profile(tmp_path / "x.json")
    (tmp_path / "x.yaml").write_text("a: [")
    with pytest.raises(ProfileFileError, match="expected valid YAML"):
        load_profile(tmp_path / "x.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ProfileFileError, match="mapping"):
        load_profile(tmp_path / "list.yaml")
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ProfileFileError, match="UTF-8"):
        load_profile(tmp_path / "bin.yaml")


def test_every_problem_of_a_profile_at_once(tmp_path, prof):
    d = prof.to_dict()
    d["colour"] = "red"
    d["layers"][0]["fwd_s"] = -1.0
    d["layers"][2]["name"] = ""
    d["seq_len"] = 0
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileFileError) as err:
        load_profile(path)
    msg = str(err.value)
    assert msg.startswith(f"profile {path}: 3 errors: ") and "colour" in msg and "layers[0].fwd_s" in msg
    assert "layers[2].name: expected a non-empty string" in msg  # seq_len is checked once the layers are right


def test_duplicate_keys_in_a_profile(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("model: a\ndevice: b\nmodel: c\n")
    with pytest.raises(
        ProfileFileError, match="model: expected each key once per mapping, found it at line 1 and again at line 3"
    ):
        load_profile(path)
