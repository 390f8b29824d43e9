"""The values a test_code execution carries between the program's process and the asserts'
(rlbatch.rewards.sandbox_codec), within one process: standard-library values come back as the
standard library's own, the program's named tuples, enums and dataclasses as structures compared
by type name and fields, and data the decoder cannot trust is a protocol error."""

from __future__ import annotations

import array
import collections
import dataclasses
import datetime
import decimal
import enum
import fractions
import json
import types

import pytest

from rlbatch.rewards.sandbox_codec import ProtocolError, Remote, Value, decode, encode


class _Handles:
    """The program side's table of handles and the asserts side's Remote for each."""

    def __init__(self):
        self.objects = {}

    def handle_of(self, obj):
        self.objects[id(obj)] = obj
        return id(obj)

    def remote_of(self, handle):
        return Remote(None, handle)


def _cross(value):
    handles = _Handles()
    wire = json.loads(json.dumps(encode(value, handles.handle_of)))
    return decode(wire, handles.remote_of)


Pair = collections.namedtuple("Pair", "a b")


class Color(enum.IntEnum):
    RED = 1
    GREEN = 2


class Shape(enum.Enum):
    ROUND = "round"
    SQUARE = "square"


@dataclasses.dataclass
class Box:
    w: int
    h: int
    label: str = dataclasses.field(default="", compare=False)


@pytest.mark.parametrize(
    "value",
    [
        collections.Counter("abracadabra"),
        collections.OrderedDict([("z", 1), ("a", 2)]),
        collections.deque([1, 2, 3], maxlen=5),
        fractions.Fraction(-7, 3),
        fractions.Fraction(10**30, 3),
        decimal.Decimal("0.1000"),
        decimal.Decimal("NaN"),
        datetime.date(2024, 2, 29),
        datetime.datetime(2024, 1, 2, 3, 4, 5, 6),
        datetime.datetime(2024, 1, 2, 3, 4, tzinfo=datetime.timezone(datetime.timedelta(hours=-5))),
        datetime.time(23, 59, 1, 5),
        datetime.timedelta(days=-1, seconds=5),
        bytearray(b"\x00\xff"),
        range(1, 10, 3),
        datetime.UTC,
        datetime.timezone(datetime.timedelta(hours=5, minutes=30), "IST"),
        types.SimpleNamespace(x=1, items=[fractions.Fraction(1, 3)]),
        array.array("d", [1.5, -0.0]),
        array.array("u", "hi"),
        [collections.Counter("ab"), {"k": fractions.Fraction(1, 2)}, (datetime.date(2000, 1, 1),)],
    ],
)  # fmt: skip
def test_standard_library_values_come_back_as_themselves(value):
    back = _cross(value)
    if isinstance(value, decimal.Decimal) and value.is_nan():
        assert type(back) is decimal.Decimal and back.is_nan()
        return
    assert type(back) is type(value)
    assert back == value
    assert repr(back) == repr(value)  # the same order, maxlen, offset, digits


def test_a_defaultdict_keeps_its_built_in_factory():
    back = _cross(collections.defaultdict(list, {1: ["a"]}))
    assert type(back) is collections.defaultdict and back == {1: ["a"]}
    assert back[2] == [] and back.default_factory is list


def test_named_tuples_are_named_tuples_equal_to_tuples():
    back = _cross(Pair(1, [2]))
    assert back == (1, [2]) and back.a == 1 and back.b == [2]
    assert type(back).__name__ == "Pair" and back._fields == ("a", "b")
    assert back is not Pair  # rebuilt by the standard library, not the sender's class


def test_dict_views_come_back_as_views_in_order():
    d = {(1, 2): [3], "a": Color.RED}
    keys, values, items = _cross(d.keys()), _cross(d.values()), _cross(d.items())
    assert type(keys) is type(d.keys()) and list(keys) == [(1, 2), "a"]
    assert keys == {(1, 2), "a"}  # a keys view equals a set, as in Python
    assert type(values) is type(d.values()) and list(values) == [[3], Color.RED]
    assert type(items) is type(d.items()) and list(items) == [((1, 2), [3]), ("a", 1)]
    assert _cross({1: "x"}.items()) == {(1, "x")}


def test_a_named_tuple_with_renamed_fields_crosses():
    row = collections.namedtuple("Row", ["id", "class", "id"], rename=True)(1, "a", 2)
    back = _cross(row)
    assert back == (1, "a", 2) and back._fields == ("id", "_1", "_2") and back._1 == "a"


def test_enums_compare_by_type_member_and_mixed_in_value():
    green, red = _cross(Color.GREEN), _cross(Color.RED)
    assert type(green) is Value
    assert green == _cross(Color.GREEN) and green != red
    assert green == 2 and 2 == green and int(green) == 2 and red < green
    assert green.name == "GREEN" and green.value == 2
    assert {green: "x"}[2] == "x"  # hashes as its int, as an IntEnum does
    square = _cross(Shape.SQUARE)
    assert square == _cross(Shape.SQUARE) and square != _cross(Shape.ROUND)
    assert square != "square"  # a plain Enum is not its value
    assert str(square) == "Shape.SQUARE"


def test_dataclasses_compare_their_compared_fields_and_type_name():
    a = _cross(Box(1, 2, "one"))
    assert type(a) is Value and a.w == 1 and a.h == 2
    assert a == _cross(Box(1, 2, "other"))  # label is compare=False
    assert a != _cross(Box(2, 1))
    assert repr(a) == "Box(w=1, h=2)"


def test_a_dataclass_of_another_type_with_the_same_fields_is_not_equal():
    @dataclasses.dataclass
    class Other:
        w: int
        h: int

    assert _cross(Box(1, 2)) != _cross(Other(1, 2))


def test_a_plain_object_is_a_handle_that_refuses_comparison():
    class Thing:
        def __eq__(self, other):
            return True

    back = _cross(Thing())
    assert type(back) is Remote
    for compare in (lambda: back == 1, lambda: back != 1, lambda: back < 1):
        with pytest.raises(TypeError, match="cannot be compared"):
            compare()
    with pytest.raises(TypeError, match="no truth value"):
        bool(back)
    for lookup in (lambda: back not in {4, 6}, lambda: back in {1: "x"}, lambda: hash(back)):
        with pytest.raises(TypeError, match="cannot be hashed"):
            lookup()


@pytest.mark.parametrize(
    "wire",
    [
        {"std": ["fractions.Fraction", [1, 0]]},  # a zero denominator
        {"std": ["datetime.date", [2023, 2, 29]]},  # no such day
        {"std": ["os.system", "true"]},  # not a value type of the table
        {"std": ["decimal.Decimal", "1" * 200_000]},  # over the text limit
        {"std": ["collections.deque", [-1, [1]]]},  # a negative maxlen
        {"n": ["no such", ["a"], [1]]},  # a type name that is not an identifier
        {"n": ["Pair", ["a"], [1, 2]]},  # more values than fields
        {"e": ["Color", "RED", "1", "int", None]},  # claims an int mixin, carries a str
        {"e": ["Color", "RED", 1, "object", None]},  # a mixin outside int, str, float
        {"dc": ["Box", [[1, 2]], None]},  # a field name that is not a str
    ],
)  # fmt: skip
def test_data_the_decoder_cannot_trust_is_a_protocol_error(wire):
    with pytest.raises(ProtocolError):
        decode(json.loads(json.dumps(wire)), _Handles().remote_of)
