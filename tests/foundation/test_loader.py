"""The one loader: every problem at once, did-you-mean, duplicate keys, exact numbers, nesting, converters,
the caller's error class, and exact YAML/JSON round trips."""

import dataclasses
import json
import pickle
import re
from dataclasses import dataclass, field

import pytest

from foundation.errors import UserError
from foundation.loader import (
    Builder,
    Checked,
    InvalidValues,
    Problem,
    at_least,
    from_plain,
    load_file,
    positive,
    save_file,
    to_plain,
)
from foundation.units import as_bytes


class ShelfError(UserError, ValueError):
    """The callers' own error class, as PlanFileError or TopologyError are."""


class InvalidShelf(InvalidValues, ShelfError):
    """What a Checked class of the callers raises."""


@dataclass(frozen=True)
class Box(Checked):
    label: str
    weight_kg: float
    size: tuple[int, int] = (1, 1)
    invalid = InvalidShelf

    def check_values(self) -> list[Problem]:
        return positive(self, "weight_kg", "weigh it again")


@dataclass(frozen=True)
class Lid:
    colour: str = "red"


@dataclass(frozen=True)
class Shelf(Checked):
    name: str
    boxes: tuple[Box, ...]
    capacity_bytes: int = field(default=0, metadata={"convert": as_bytes, "fix": "write e.g. 24GiB"})
    lid: Lid | None = None
    rows: tuple[tuple[str, ...], ...] = ()
    note: str | None = None
    where: str = field(default="<nowhere>", metadata={"in_file": False})
    invalid = InvalidShelf

    def check_values(self) -> list[Problem]:
        return at_least(self, "capacity_bytes", 0, "a shelf holds no negative bytes")


GOOD = {
    "name": "top",
    "boxes": [{"label": "a", "weight_kg": 1.5}, {"label": "b", "weight_kg": 2, "size": [3, 4]}],
    "capacity_bytes": "2GiB",
    "lid": {"colour": "blue"},
    "rows": [["x", "y"], []],
}


def _load(data, **kw):
    return from_plain(Shelf, data, where="shelf <dict>", error=ShelfError, **kw)


def _error(data, **kw) -> str:
    with pytest.raises(ShelfError) as info:
        _load(data, **kw)
    return str(info.value)


def test_builds_nested_optional_and_tuple_of_dataclass_fields():
    shelf = _load(GOOD)
    assert shelf.boxes == (Box("a", 1.5), Box("b", 2.0, (3, 4)))
    assert type(shelf.boxes[1].weight_kg) is float and shelf.lid == Lid("blue")
    assert shelf.capacity_bytes == 2 * 2**30 and shelf.rows == (("x", "y"), ())
    assert _load({"name": "n", "boxes": [], "lid": None}).lid is None


def test_unknown_key_suggests_the_closest():
    message = _error({**GOOD, "boxs": []})
    assert message.startswith("shelf <dict>: boxs: expected one of the keys of the top level: name, boxes,")
    assert "found unknown key 'boxs'; fix: did you mean 'boxes'?" in message
    message = _error({**GOOD, "boxes": [{"label": "a", "wieght_kg": 1}]})
    assert "boxes[0].wieght_kg: expected one of the keys of boxes[0]: label, weight_kg, size" in message
    assert "did you mean 'weight_kg'?" in message


def test_every_problem_at_once_on_one_line():
    data = {
        "name": 5,
        "boxes": [{"label": "a", "weight_kg": -1}, {"label": "b"}, "c"],
        "colour": 1,
        "capacity_bytes": "lots",
        "lid": {"colour": True},
    }
    message = _error(data)
    assert "\n" not in message
    head, *items = re.split(r" \(\d+\) ", message)
    assert head == "shelf <dict>: 7 errors:"
    keys = [item.split(":")[0] for item in items]
    assert keys == [
        "name",
        "boxes[0].weight_kg",
        "boxes[1].weight_kg",
        "boxes[2]",
        "colour",
        "capacity_bytes",
        "lid.colour",
    ]
    assert "boxes[0].weight_kg: expected a finite number > 0, found number -1.0; fix: weigh it again" in message
    assert "boxes[1].weight_kg: expected a number (a required key), found nothing: the key is missing" in message
    assert "boxes[2]: expected a mapping with keys among label, weight_kg, size, found string 'c'" in message


@pytest.mark.parametrize(
    "data, needle",
    [
        ({**GOOD, "name": True}, "name: expected a string, found boolean True; fix: yes/no/on/off/true/false"),
        ({**GOOD, "boxes": [{"label": "a", "weight_kg": "2.5"}]}, "found string '2.5'; fix: remove the quotes"),
        ({**GOOD, "boxes": [{"label": "a", "weight_kg": False}]}, "found boolean False; fix: true/false is not a"),
        (
            {**GOOD, "boxes": [{"label": "a", "weight_kg": 1, "size": [1]}]},
            "boxes[0].size: expected a list of 2 integers",
        ),
        ({**GOOD, "boxes": {"label": "a"}}, "boxes: expected a list of mappings, found mapping"),
        ({**GOOD, "rows": [["x", 3]]}, "rows[0][1]: expected a string, found integer 3"),
        ({**GOOD, "rows": "x"}, "rows: expected a list of lists of strings, found string 'x'"),
        ({**GOOD, "lid": "blue"}, "lid: expected a mapping with keys among colour, found string 'blue'"),
        ({**GOOD, "note": 3}, "note: expected a string or null, found integer 3"),
        ({**GOOD, "where": "x"}, "where: expected one of the keys"),
        ([1, 2], "(top level): expected a mapping with keys among name, boxes"),
        (None, "(top level): expected a mapping"),
    ],
)
def test_wrong_types_name_the_key_the_expected_type_and_a_fix(data, needle):
    message = _error(data)
    assert needle in message and "; fix: " in message


def test_converter_from_field_metadata():
    assert _load({**GOOD, "capacity_bytes": 7}).capacity_bytes == 7
    message = _error({**GOOD, "capacity_bytes": "1.5B"})
    assert "capacity_bytes: expected a whole number of bytes (1.5B is 1.5 bytes), found string '1.5B'" in message
    assert "fix: write e.g. 24GiB" in message


def test_error_is_the_callers_class_and_checked_classes_raise_their_own():
    with pytest.raises(ShelfError):
        _load({"boxes": []})
    with pytest.raises(InvalidShelf, match=r"^Box: weight_kg: expected a finite number > 0, found number 0\.0"):
        Box("a", 0)
    with pytest.raises(ShelfError, match="Box: 2 errors: .*label: expected a string.*size: expected a list"):
        Box(7, 1.0, (1,))  # type: ignore[arg-type]
    again = pickle.loads(pickle.dumps(InvalidShelf("Box", [Problem("k", "e", "f", "x")])))
    assert isinstance(again, InvalidShelf) and again.problems == (Problem("k", "e", "f", "x"),)


def test_checks_for_classes_the_caller_does_not_own():
    def lid_check(lid) -> list[Problem]:
        return [] if lid.colour != "pink" else [Problem("colour", "not pink", repr(lid.colour), "paint it")]

    assert _load({**GOOD, "lid": {}}, checks={Lid: lid_check}).lid == Lid()
    message = _error({**GOOD, "lid": {"colour": "pink"}}, checks={Lid: lid_check})
    assert "lid.colour: expected not pink, found 'pink'; fix: paint it" in message


def test_extra_gives_fields_that_are_not_keys():
    assert _load(GOOD, extra={"where": "here"}).where == "here"


def test_builder_collects_problems_across_several_builds():
    builder = Builder("two things", ShelfError)
    builder.build(Box, {"label": 1, "weight_kg": 1}, "first")
    builder.value(tuple[Box, ...], [{"label": "x"}], "second")
    with pytest.raises(ShelfError, match=r"two things: 2 errors: \(1\) first\.label: .* \(2\) second\[0\]\.weight_kg"):
        builder.finish(None)


# ---- files ----


def _write(tmp_path, text: str, name: str = "shelf.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _load_file(path):
    return load_file(Shelf, path, what="shelf", error=ShelfError, fix="write one with save_file")


def _file_error(path) -> str:
    with pytest.raises(ShelfError) as info:
        _load_file(path)
    assert str(info.value).startswith(f"shelf {path}: ")
    return str(info.value)


def test_duplicate_keys_in_yaml_name_both_lines(tmp_path):
    path = _write(tmp_path, "name: a\nboxes:\n  - {label: x, weight_kg: 1, label: y}\nname: b\n")
    message = _file_error(path)
    assert "2 errors" in message
    twice = "boxes[0].label: expected each key once per mapping, found it at line 3, column 6 and again at column 30"
    assert twice in message
    assert "name: expected each key once per mapping, found it at line 1 and again at line 4" in message


def test_duplicate_keys_in_json(tmp_path):
    path = _write(tmp_path, '{"name": "a", "boxes": [{"label": "x", "weight_kg": 1, "label": "y"}]}', "s.json")
    assert "boxes[0].label: expected each key once per object, found it twice" in _file_error(path)


def test_exponent_without_a_dot_is_a_float_in_yaml_and_json_floats_stay_floats(tmp_path):
    shelf = _load_file(_write(tmp_path, "name: a\nboxes: [{label: x, weight_kg: 3e-3}, {label: y, weight_kg: 1E5}]\n"))
    assert [b.weight_kg for b in shelf.boxes] == [0.003, 1e5]
    shelf = _load_file(_write(tmp_path, '{"name": "a", "boxes": [{"label": "x", "weight_kg": 1e-05}]}', "s.json"))
    assert shelf.boxes[0].weight_kg == 1e-05


@pytest.mark.parametrize(
    "text, name, needle",
    [
        ("name: [a\n", "s.yaml", "expected valid YAML, found while parsing"),
        ('{"name": "a",}', "s.json", "expected valid JSON, found Expecting property name"),
        (b"\xff\xfe", "s.yaml", "expected UTF-8 text, found byte 0xff at offset 0"),
    ],
)
def test_unreadable_files(tmp_path, text, name, needle):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert needle in _file_error(path)


def test_missing_file_and_folder(tmp_path):
    assert "file not found" in _file_error(tmp_path / "none.yaml")
    assert "fix: write one with save_file" in _file_error(tmp_path / "none.yaml")
    assert "cannot be read (Is a directory)" in _file_error(tmp_path)


AWKWARD = Shelf(
    name="1e5",
    boxes=(
        Box("yes", 1e-05, (0, 2**40)),
        Box("null", 5e-324, (-3, 7)),
        Box("0x1F", 1 / 3, (1, 1)),
        Box("3.0", 1e16, (1, 1)),
    ),
    capacity_bytes=2**45,
    lid=Lid("on"),
    rows=(("1e-3", "~", "", "a: b"), ()),
    note="é",
)


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_round_trip_is_exact(tmp_path, suffix):
    path = save_file(AWKWARD, tmp_path / f"shelf{suffix}", header="# a shelf\n")
    assert _load_file(path) == AWKWARD
    assert path.read_text(encoding="utf-8").startswith("# a shelf\n" if suffix != ".json" else "{")
    if suffix == ".json":
        assert json.loads(path.read_text()) == to_plain(AWKWARD)


def test_to_plain_leaves_out_fields_that_are_not_keys():
    plain = to_plain(dataclasses.replace(AWKWARD, where="x"))
    assert "where" not in plain and plain["boxes"][0] == {"label": "yes", "weight_kg": 1e-05, "size": [0, 2**40]}


@dataclass(frozen=True)
class Job:
    script: str = field(metadata={"path_fix": "point it at an existing script"})


def test_path_fields_start_at_the_files_folder(tmp_path):
    (tmp_path / "run.sh").write_text("true")
    path = _write(tmp_path, "script: run.sh\n", "job.yaml")
    job = load_file(Job, path, what="job", error=ShelfError, fix="x")
    assert job.script == str(tmp_path / "run.sh")
    path.write_text("script: nope.sh\n")
    with pytest.raises(
        ShelfError,
        match=r"script: expected an existing file.*nope\.sh.*which does not exist; fix: "
        r"point it at an existing script",
    ):
        load_file(Job, path, what="job", error=ShelfError, fix="x")


@dataclass(frozen=True)
class Library:
    folder: str = field(metadata={"folder_fix": "point it at the folder of books"})


def test_folder_fields_start_at_the_files_folder_and_must_be_folders(tmp_path):
    (tmp_path / "books").mkdir()
    (tmp_path / "note.txt").write_text("x")
    path = _write(tmp_path, "folder: books\n", "shelf.yaml")
    assert load_file(Library, path, what="shelf", error=ShelfError, fix="x").folder == str(tmp_path / "books")
    for name, found in (("note.txt", "a file"), ("nope", "which does not exist")):
        path.write_text(f"folder: {name}\n")
        with pytest.raises(
            ShelfError, match=rf"folder: expected an existing folder.*{found}; fix: point it at the folder of books"
        ):
            load_file(Library, path, what="shelf", error=ShelfError, fix="x")


@dataclass(frozen=True)
class Report:
    out: str = field(default="", metadata={"out_path": True})
    machine: str = field(default="", metadata={"path_fix": "save one", "path_suffixes": (".yaml",)})


def test_written_paths_and_names_or_paths_start_at_the_files_folder(tmp_path):
    (tmp_path / "box.yaml").write_text("x: 1\n")
    path = _write(tmp_path, "out: runs/a\nmachine: box.yaml\n", "report.yaml")
    got = load_file(Report, path, what="report", error=ShelfError, fix="x")
    assert got.out == str(tmp_path / "runs" / "a") and not (tmp_path / "runs").exists()  # need not exist
    assert got.machine == str(tmp_path / "box.yaml")
    path.write_text("out: ''\nmachine: 2+2\n")  # "" is left for the class to judge; a name is not a path
    assert load_file(Report, path, what="report", error=ShelfError, fix="x") == Report("", "2+2")
    path.write_text("machine: gone.yaml\n")
    with pytest.raises(ShelfError, match=r"machine: expected an existing file.*gone\.yaml.*fix: save one"):
        load_file(Report, path, what="report", error=ShelfError, fix="x")


@dataclass(frozen=True)
class Counted:
    count: int = field(metadata={"example": "42"})


def test_a_missing_keys_fix_shows_the_fields_example():
    with pytest.raises(ShelfError, match=r"count: expected an integer \(a required key\).*fix: add `count: 42`"):
        from_plain(Counted, {}, where="c", error=ShelfError)


def test_an_integer_must_fit_in_64_bits():
    assert from_plain(Counted, {"count": 2**63 - 1}, where="c", error=ShelfError).count == 2**63 - 1
    for big in (2**63, -(2**63) - 1, 10**30):
        with pytest.raises(ShelfError, match=r"count: expected an integer of 64 bits.*fix: write a smaller count"):
            from_plain(Counted, {"count": big}, where="c", error=ShelfError)


def test_a_control_character_is_a_yaml_error_with_its_place(tmp_path):
    path = _write(tmp_path, "label: ok\nweight_kg: 1\x08\n", "box.yaml")
    with pytest.raises(ShelfError, match=r"box\.yaml: expected valid YAML, found the character '\\x08' .* line 2, col"):
        load_file(Box, path, what="box", error=ShelfError, fix="x")


def test_nothing_is_built_on_a_missing_path(tmp_path):
    """A class's own check never sees a path that is not there (it might open it): the path's problem is reported."""
    opened = []

    @dataclass(frozen=True)
    class Opens(Checked):
        script: str = field(metadata={"path_fix": "point it at a script"})

        def check_values(self) -> list[Problem]:
            opened.append(self.script)
            return []

    with pytest.raises(ShelfError, match="script: expected an existing file"):
        from_plain(Opens, {"script": "nope.sh"}, where="o", error=ShelfError, base_dir=str(tmp_path))
    assert opened == []


@pytest.mark.parametrize("key", ["\n", "a\tb", " ", "", "x\x00"])
def test_a_key_the_message_cannot_show_as_text_is_quoted(key):
    """A key with a line break or other unprintable characters (found by test_fuzz's layouts) is written as Python
    writes it, so an error message stays one line and says which key."""
    from foundation.checked import join_key

    joined = join_key("gpus[0]", key)
    assert joined == f"gpus[0][{key!r}]" and joined.isprintable()
    assert join_key("train", "lr") == "train.lr" and join_key("gpus", "[2]") == "gpus[2]" and join_key("", "k") == "k"
