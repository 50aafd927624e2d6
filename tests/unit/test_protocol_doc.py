"""docs/protocol.md and codec/messages.py say the same: every message type and field is documented.

The spec is a document (it is what a second client is written from); this
keeps it from drifting from the code in either direction.
"""

from __future__ import annotations

import re

import msgspec

from remotorch.codec import messages as m

from helpers import REPO

DOC = (REPO / "docs" / "protocol.md").read_text(encoding="utf-8")
ROW_TAG = re.compile(r'^\| `"([a-z_]+)"` ')


def tagged_structs() -> dict[str, type]:
    found = {}
    for value in vars(m).values():
        if isinstance(value, type) and issubclass(value, msgspec.Struct) and value.__struct_config__.tag:
            found[value.__struct_config__.tag] = value
    return found


def rows(tag: str) -> list[str]:
    return [line for line in DOC.splitlines() if line.startswith(f'| `"{tag}"` ')]


def between(start: str, end: str) -> str:
    return DOC[DOC.index(start):DOC.index(end)]


def test_every_message_type_has_a_row_in_the_spec():
    undocumented = [tag for tag, cls in tagged_structs().items() if not rows(tag)]
    assert not undocumented, undocumented


def test_every_field_is_named_in_its_row():
    missing = []
    for tag, cls in tagged_structs().items():
        for row in rows(tag):
            if cls.__struct_config__.array_like:  # ["t", TensorMeta]: positional, named by the row's form
                continue
            for field in cls.__struct_fields__:
                if f"`{field}`" not in row:
                    missing.append(f"{cls.__name__}.{field}")
    assert not missing, missing


def test_the_envelope_and_its_housekeeping_are_documented():
    """`pending` is the envelope's third element (no message has it as a field), with every field of Pending."""
    assert m.Envelope.__struct_fields__ == ("v", "body", "pending", "seq", "ack")
    assert not [cls.__name__ for cls in tagged_structs().values() if "pending" in cls.__struct_fields__]
    section = between("## 7. Frame 0: the envelope", "### 7.1 TensorMeta")
    assert "[v, body, pending]" in section and "[v, body, pending, seq, ack]" in section
    for i, field in enumerate(m.Pending.__struct_fields__):  # array form: the row gives its position
        assert f"| {i} | `{field}` |" in section, field


def test_every_default_is_listed_with_its_value():
    """A sender may leave out a field holding its default (remotorch's own peers do), so a reader of the
    spec must know exactly which fields have one, and which value: §7 lists them, grouped by value."""
    groups = {"empty array": [], "`0` or `0.0`": 0, "`false`": False, "nil": None, "empty bin": b"",
              "empty map": {}}
    written = {"true": True, "false": False, "nil": None}  # the "others" bullet: `Message.field` (value)
    documented = {}
    for bullet in re.split(r"\n\* ", between("The fields with defaults are:", "Example, a `Run` request"))[1:]:
        head, body = bullet.split(":", 1)
        for name, value in re.findall(r"`([A-Z]\w*\.\w+)`(?: \(([^)]*)\))?", body):
            documented[name] = groups[head] if head in groups else written.get(value, value)
    actual = {}
    for cls in tagged_structs().values():
        for f in msgspec.structs.fields(cls):
            if not f.required:
                default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
                actual[f"{cls.__name__}.{f.name}"] = default
    assert sorted(documented) == sorted(actual)
    wrong = {name: (documented[name], value) for name, value in actual.items()
             if not _same(documented[name], value)}
    assert not wrong, wrong


def _same(documented, value) -> bool:
    if isinstance(documented, str):  # a number as the spec writes it
        return documented == str(value)
    if isinstance(documented, bool) or isinstance(value, bool):  # False is not 0
        return documented is value
    return documented == value


def test_field_references_name_real_fields():
    """`Message.field` anywhere in the spec names a field that message has (no leftovers of renamed ones)."""
    structs = {name: cls for name, cls in vars(m).items()
               if isinstance(cls, type) and issubclass(cls, msgspec.Struct)}
    stale = []
    for ref in set(re.findall(r"`([A-Z]\w*\.\w+)`", DOC)):  # Limits.max_tensor_bytes etc. are not messages
        name, field = ref.split(".")
        if name in structs and field not in structs[name].__struct_fields__:
            stale.append(ref)
    assert not stale, stale


GRAPH_NODE_OPS = {"placeholder", "call", "const", "output"}  # node kinds of a graph document (§12), not messages


def test_the_spec_documents_no_message_the_code_lacks():
    known = set(tagged_structs()) | GRAPH_NODE_OPS
    documented = {ROW_TAG.match(line).group(1) for line in DOC.splitlines() if ROW_TAG.match(line)}
    assert documented - known == set()


def test_the_spec_states_the_protocol_version():
    v = m.PROTOCOL_VERSION
    assert DOC.startswith(f"# remotorch wire protocol, version {v}\n")
    assert f"The protocol version is **{v}**." in DOC
    assert f"v = {v};" in between("## 7. Frame 0: the envelope", "### 7.1 TensorMeta")
