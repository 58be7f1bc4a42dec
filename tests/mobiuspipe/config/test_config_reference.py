"""The config reference in docs/config.md is the one the dataclasses give, and every key has a meaning."""

import dataclasses
import typing

from mobiuspipe.config import RunConfig
from mobiuspipe.config.reference import DOC, block, field_docs, main, reference


def test_the_page_holds_the_current_reference():
    assert block(DOC.read_text()) == reference(), (
        "docs/config.md's reference is stale: run `python -m mobiuspipe.config.reference --write` and commit it"
    )


def test_every_key_of_every_section_has_a_meaning():
    hints = typing.get_type_hints(RunConfig)
    missing = [
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(RunConfig)
        if dataclasses.is_dataclass(hints[section.name])
        for f in dataclasses.fields(hints[section.name])
        if not field_docs(hints[section.name]).get(f.name)
    ]
    assert not missing, f"config keys without a docstring under their field: {missing}"


def test_a_table_row_per_key_with_its_default(capsys):
    assert main([]) == 0
    text = capsys.readouterr().out
    assert "| `deterministic` | `false` |" in text and "| `betas` | `[0.9, 0.95]` |" in text
    assert "| `hf` | `null` |" in text and "### `runtime:`" in text


def test_field_docs_reads_the_string_under_each_field():
    @dataclasses.dataclass
    class Example:
        a: int = 1
        """The first,
        over two lines."""
        b: int = 2
        c: int = 3
        """The third."""

    assert field_docs(Example) == {"a": "The first, over two lines.", "c": "The third."}
