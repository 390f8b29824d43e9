"""The values the two sides of a ``test_code`` execution exchange, and their codec; standard
library only (it runs inside the sandbox, on both sides).

A program's answer crosses as **data** rebuilt by the receiving side's own decoder
(:func:`decode`):

- plain data: None, bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset,
  and a dict's ``keys()`` / ``values()`` / ``items()`` views;
- standard-library values rebuilt from the receiving side's own standard library (:data:`STD`:
  ``Counter``, ``OrderedDict``, ``defaultdict``, ``deque``, ``Fraction``, ``Decimal``,
  ``date``, ``time``, ``datetime``, ``timedelta``, ``timezone``, ``SimpleNamespace``,
  ``array``, ``bytearray``, ``range``), in containers
  or alone;
- the program's own named tuples, rebuilt as named tuples of the standard library (type name
  and fields: equal to a tuple of the same items, as in Python); its enum members and
  dataclass instances, rebuilt as :class:`Value` (type name and fields, compared field by
  field, never through the program's ``__eq__``; an ``IntEnum``/``StrEnum`` member is also
  equal to its value), whose other attributes and methods are read through the program.

Anything else comes back as a :class:`Remote` handle that refuses to be compared and has no
truth value, so an object whose ``__eq__`` is always true (or never true) proves nothing.
The decoder calls nothing of the program and builds only the types above, from values it
checks: whatever the program does to its own interpreter only changes what it answers.
"""

import builtins
import math
import sys

MAX_MESSAGE = 16 * 1024 * 1024
"""Longest message either side reads (a larger one is a protocol error: the test fails)."""
MAX_TEXT = 100_000
"""Longest Decimal text decoded (a longer one is a protocol error)."""

_PLAIN_SCALARS = (type(None), bool, int, float, str)
_NO_BASE = object()
_VIEWS = {type({}.keys()): "keys", type({}.values()): "values", type({}.items()): "items"}
"""A dict's views (``d.keys()``, ``d.values()``, ``d.items()``), rebuilt as views of a dict of
the same items in the same order (a keys or items view equals a set, as in Python)."""
_FACTORIES = ("int", "float", "str", "list", "dict", "set", "tuple", "frozenset", "bytes")
"""Built-in types a ``defaultdict`` crosses with as its default factory (by name)."""


class ProtocolError(Exception):
    """The other side sent something that is not a well-formed message."""


# ---------------------------------------------------------------- values of the program's types


class Value:
    """An enum member or a dataclass instance of the program, as its type name and fields.

    Equal to another Value of the same kind, type name and fields (for a dataclass, the fields
    it compares), and, for an enum with an int, str or float mixin, to that value, as in
    Python; its attributes are its fields, any other attribute (a method) is the program's,
    read through its handle. Nothing here runs the program's code."""

    __slots__ = ("_base", "_fields", "_kind", "_remote", "_type")

    def __init__(self, kind, type_name, fields, base=_NO_BASE, remote=None):
        for name, value in (("_kind", kind), ("_type", type_name), ("_fields", fields),
                            ("_base", base), ("_remote", remote)):  # fmt: skip
            object.__setattr__(self, name, value)

    def _key(self):
        return (self._kind, self._type, self._fields)

    def __eq__(self, other):
        if self._base is not _NO_BASE:
            return self._base == (other._base if type(other) is Value else other)
        if type(other) is Value:
            return self._key() == other._key()
        return NotImplemented

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self):
        return hash(self._base) if self._base is not _NO_BASE else hash(self._key())

    def _order(self, other, op):
        if self._base is _NO_BASE:
            return NotImplemented
        return op(self._base, other._base if type(other) is Value else other)

    def __lt__(self, other):
        return self._order(other, lambda a, b: a < b)

    def __le__(self, other):
        return self._order(other, lambda a, b: a <= b)

    def __gt__(self, other):
        return self._order(other, lambda a, b: a > b)

    def __ge__(self, other):
        return self._order(other, lambda a, b: a >= b)

    def __int__(self):
        return int(self._base)

    def __index__(self):
        if type(self._base) is not int:
            raise TypeError(f"{self._type} is not an int")
        return self._base

    def __float__(self):
        return float(self._base)

    def __bool__(self):
        return bool(self._base) if self._base is not _NO_BASE else True

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        for field, value in self._fields:
            if field == name:
                return value
        if self._remote is None:
            raise AttributeError(f"{self._type!r} value has no attribute {name!r}")
        return getattr(self._remote, name)

    def __setattr__(self, name, value):
        raise TypeError("a value of the program cannot be changed from the tests")

    def __repr__(self):
        if self._kind == "enum":
            return f"<{self._type}.{self._fields[0][1]}: {self._fields[1][1]!r}>"
        return f"{self._type}({', '.join(f'{k}={v!r}' for k, v in self._fields)})"

    def __str__(self):
        if self._kind == "enum":
            base = self._base
            return str(base) if base is not _NO_BASE else f"{self._type}.{self._fields[0][1]}"
        return repr(self)


class Remote:
    """A value of the program that crosses as none of the data above (an object of a plain
    class of the program, a generator, a function): callable, iterable, indexable and printable
    through the program, but it refuses to be compared (``==``, ``!=``, ``<``: an always-equal
    or never-equal object proves nothing) or hashed (``f(x) not in {4, 5}``) and has no truth
    value."""

    __slots__ = ("_client", "_handle")

    def __init__(self, client, handle):
        object.__setattr__(self, "_client", client)
        object.__setattr__(self, "_handle", handle)

    def __call__(self, *args, **kwargs):
        return self._client.request("call", self._handle, args=list(args), kwargs=kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._client.request("getattr", self._handle, name=name)

    def __iter__(self):
        iterator = self._client.request("iter", self._handle)
        if type(iterator) is not Remote:
            raise TypeError("iter() of a program's value is not an iterator")
        while True:
            try:
                yield self._client.request("next", iterator._handle)
            except StopIteration:
                return

    def __next__(self):
        return self._client.request("next", self._handle)

    def __len__(self):
        n = self._client.request("len", self._handle)
        if type(n) is not int:
            raise TypeError("len() of a program's value is not an int")
        return n

    def __getitem__(self, key):
        return self._client.request("getitem", self._handle, key=key)

    def __str__(self):
        return self._text("str")

    def __repr__(self):
        return self._text("repr")

    def _text(self, op):
        text = self._client.request(op, self._handle)
        if type(text) is not str:
            raise TypeError(f"{op}() of a program's value is not a str")
        return text

    def _refuse(self, other):
        raise TypeError(
            "a value of the program that is not data (an object of its own class) cannot be"
            " compared: return data (numbers, strings, containers, named tuples, dataclasses)"
        )

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse

    def __hash__(self):
        # a set or dict lookup compares by hash first: an opaque object is "not in" any set
        raise TypeError(
            "a value of the program that is not data cannot be hashed (a set or dict key)"
        )

    def __bool__(self):
        raise TypeError("a value of the program that is not data has no truth value")

    def __setattr__(self, name, value):
        raise TypeError("a value of the program cannot be changed from the tests")


def _namedtuple(type_name, fields, cache={}):  # noqa: B006 - one cache per process
    key = (type_name, tuple(fields))
    if key not in cache:
        import collections

        if len(cache) > 1000:
            cache.clear()
        # rename: the program's own named tuple may have been made with rename=True ('_1')
        cache[key] = collections.namedtuple(type_name, fields, rename=True)
    return cache[key]


# ---------------------------------------------------------------- the standard library's values


def _pairs(value, handle_of):
    return [[encode(k, handle_of), encode(v, handle_of)] for k, v in value.items()]


def _tz(value):
    """A datetime's or time's offset as [days, seconds, microseconds] (None: naive); raises
    TypeError for a tzinfo other than datetime.timezone (it crosses as a handle)."""
    import datetime

    if value.tzinfo is None:
        return None
    if type(value.tzinfo) is not datetime.timezone:
        raise TypeError("a tzinfo other than datetime.timezone")
    offset = value.utcoffset()
    return [offset.days, offset.seconds, offset.microseconds]


def _tz_parts(zone):
    """A timezone as its offset and its name (None: the name its offset gives it)."""
    offset = zone.utcoffset(None)
    name = zone.tzname(None)
    unnamed = type(zone)(offset).tzname(None)
    return [offset.days, offset.seconds, offset.microseconds, None if name == unnamed else name]


def _tz_of(data):
    import datetime

    if data is None:
        return None
    return datetime.timezone(datetime.timedelta(*_ints(data, 3)))


def _ints(data, n):
    if type(data) is not list or len(data) != n or any(type(x) is not int for x in data):
        raise ProtocolError(f"not {n} ints: {str(data)[:80]}")
    return data


def _factory_name(factory, handle_of):
    if factory is None:
        return None
    name = getattr(factory, "__name__", None)
    if name in _FACTORIES and getattr(builtins, name) is factory:
        return name
    if handle_of is None:
        raise TypeError("a defaultdict whose factory is not a built-in type cannot cross")
    return {"h": handle_of(factory)}


def _factory(data, remote_of):
    if data is None:
        return None
    if type(data) is str and data in _FACTORIES:
        return getattr(builtins, data)
    return decode(data, remote_of)


def _decimal(text):
    import decimal

    if type(text) is not str or len(text) > MAX_TEXT:
        raise ProtocolError("a Decimal that is not a short text")
    return decimal.Decimal(text)


def _datetime(data):
    import datetime

    fields = _ints(data[:8], 8)
    return datetime.datetime(*fields[:7], fold=fields[7], tzinfo=_tz_of(data[8]))


def _time(data):
    import datetime

    fields = _ints(data[:5], 5)
    return datetime.time(*fields[:4], fold=fields[4], tzinfo=_tz_of(data[5]))


def _timezone(data):
    import datetime

    days, seconds, micro, name = _list(data, 4)
    offset = datetime.timedelta(*_ints([days, seconds, micro], 3))
    return datetime.timezone(offset) if name is None else datetime.timezone(offset, _str(name))


def _namespace(data, remote_of):
    import types

    return types.SimpleNamespace(**{_str(k): v for k, v in _decoded_pairs(data, remote_of)})


def _array(data, remote_of):
    import array

    typecode, items = _list(data, 2)
    return array.array(_str(typecode), [decode(x, remote_of) for x in _list(items)])


def _module_object(module, name):
    import importlib

    return getattr(importlib.import_module(module), name)


STD = {
    ("collections", "Counter"): (
        lambda v, h: _pairs(v, h),
        lambda d, r: _module_object("collections", "Counter")(dict(_decoded_pairs(d, r))),
    ),
    ("collections", "OrderedDict"): (
        lambda v, h: _pairs(v, h),
        lambda d, r: _module_object("collections", "OrderedDict")(_decoded_pairs(d, r)),
    ),
    ("collections", "defaultdict"): (
        lambda v, h: [_factory_name(v.default_factory, h), _pairs(v, h)],
        lambda d, r: _module_object("collections", "defaultdict")(
            _factory(d[0], r), _decoded_pairs(d[1], r)
        ),
    ),
    ("collections", "deque"): (
        lambda v, h: [v.maxlen, [encode(x, h) for x in v]],
        lambda d, r: _module_object("collections", "deque")(
            [decode(x, r) for x in _list(d[1])], d[0] if d[0] is None else _ints([d[0]], 1)[0]
        ),
    ),
    ("fractions", "Fraction"): (
        lambda v, h: [encode(v.numerator), encode(v.denominator)],
        lambda d, r: _module_object("fractions", "Fraction")(
            *_ints([decode(x) for x in _list(d)], 2)
        ),
    ),
    ("decimal", "Decimal"): (lambda v, h: str(v), lambda d, r: _decimal(d)),
    ("datetime", "date"): (
        lambda v, h: [v.year, v.month, v.day],
        lambda d, r: _module_object("datetime", "date")(*_ints(d, 3)),
    ),
    ("datetime", "datetime"): (
        lambda v, h: [
            v.year,
            v.month,
            v.day,
            v.hour,
            v.minute,
            v.second,
            v.microsecond,
            v.fold,
            _tz(v),
        ],  # fmt: skip
        lambda d, r: _datetime(_list(d, 9)),
    ),
    ("datetime", "time"): (
        lambda v, h: [v.hour, v.minute, v.second, v.microsecond, v.fold, _tz(v)],
        lambda d, r: _time(_list(d, 6)),
    ),
    ("datetime", "timedelta"): (
        lambda v, h: [v.days, v.seconds, v.microseconds],
        lambda d, r: _module_object("datetime", "timedelta")(*_ints(d, 3)),
    ),
    ("datetime", "timezone"): (
        lambda v, h: _tz_parts(v),
        lambda d, r: _timezone(d),
    ),
    ("types", "SimpleNamespace"): (
        lambda v, h: [[k, encode(x, h)] for k, x in vars(v).items()],
        _namespace,
    ),
    ("array", "array"): (lambda v, h: [v.typecode, [encode(x, h) for x in v]], _array),
    ("builtins", "bytearray"): (lambda v, h: v.hex(), lambda d, r: bytearray.fromhex(_str(d))),
    ("builtins", "range"): (
        lambda v, h: [encode(v.start), encode(v.stop), encode(v.step)],
        lambda d, r: range(*_ints([decode(x) for x in _list(d)], 3)),
    ),
}
"""(module, type name) -> (encoder of a value of exactly that type into JSON-ready data, decoder
of that data into a value built by this side's own standard library). A type crosses only when
its module is already imported on the sending side (no value of it can exist otherwise)."""


def _list(data, n=None):
    if type(data) is not list or (n is not None and len(data) != n):
        raise ProtocolError(f"not a list: {str(data)[:80]}")
    return data


def _str(data):
    if type(data) is not str or len(data) > MAX_MESSAGE:
        raise ProtocolError(f"not a text: {str(data)[:80]}")
    return data


def _decoded_pairs(data, remote_of):
    return [(decode(p[0], remote_of), decode(p[1], remote_of)) for p in map(_pair, _list(data))]


def _pair(data):
    return _list(data, 2)


def _std_key(kind):
    """The STD key of ``kind`` when it is exactly that standard-library type, else None."""
    key = (getattr(kind, "__module__", None), getattr(kind, "__qualname__", None))
    if key not in STD:
        return None
    module = sys.modules.get(key[0])
    return key if module is not None and getattr(module, key[1], None) is kind else None


# ---------------------------------------------------------------- codec


def encode(value, handle_of=None):
    """A JSON-ready form of ``value``: exact built-in types, the standard library's values of
    :data:`STD`, named tuples, enum members and dataclass instances. ``handle_of(obj)`` gives
    the handle of anything else (None: raise TypeError)."""
    kind = type(value)
    if kind is int and value.bit_length() > 64:  # hex: no digit limit (decimal has one)
        return {"i": format(value, "x")}
    if kind in _PLAIN_SCALARS:
        if kind is float and not math.isfinite(value):
            return {"x": repr(value)}
        return value
    if kind is list:
        return [encode(v, handle_of) for v in value]
    if kind is tuple:
        return {"t": [encode(v, handle_of) for v in value]}
    if kind is dict:
        return {"d": _pairs(value, handle_of)}
    if kind is set or kind is frozenset:
        return {"s" if kind is set else "f": [encode(v, handle_of) for v in value]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [encode(value.real), encode(value.imag)]}
    if kind is Remote:
        return {"h": value._handle}
    if kind is Value and value._remote is not None:
        return {"h": value._remote._handle}
    return _encode_other(value, kind, handle_of)


def _encode_other(value, kind, handle_of):
    view = _VIEWS.get(kind)
    if view is not None:
        items = value if view != "items" else ([k, v] for k, v in value)
        return {"v": [view, [encode(x, handle_of) for x in items]]}
    key = _std_key(kind)
    if key is not None:
        try:
            return {"std": [f"{key[0]}.{key[1]}", STD[key][0](value, handle_of)]}
        except TypeError:
            if handle_of is None:
                raise
            return {"h": handle_of(value)}
    fields = getattr(kind, "_fields", None) if isinstance(value, tuple) else None
    if type(fields) is tuple and len(fields) == len(value) and kind is not tuple:
        names = [f for f in fields if type(f) is str]
        return {"n": [kind.__name__, names, [encode(v, handle_of) for v in value]]}
    if handle_of is None:
        raise TypeError(f"a {kind.__name__} is not plain data and cannot reach the program")
    enum = sys.modules.get("enum")
    if enum is not None and isinstance(value, enum.Enum):
        mixin = next((t.__name__ for t in (int, str, float) if isinstance(value, t)), None)
        body = [kind.__qualname__, value._name_, encode(value._value_, handle_of), mixin]
        return {"e": [*body, handle_of(value)]}
    dataclasses = sys.modules.get("dataclasses")
    params = getattr(kind, "__dataclass_params__", None)
    if dataclasses is not None and params is not None and getattr(params, "eq", False):
        fields = [[f.name, encode(getattr(value, f.name), handle_of)]
                  for f in dataclasses.fields(value) if f.compare]  # fmt: skip
        return {"dc": [kind.__qualname__, fields, handle_of(value)]}
    return {"h": handle_of(value)}


def decode(data, remote_of=None):
    """The value ``data`` (from :func:`encode`) stands for, built from built-in types, this
    side's standard library and :class:`Value` only."""
    kind = type(data)
    if kind in _PLAIN_SCALARS:
        return data
    if kind is list:
        return [decode(v, remote_of) for v in data]
    if kind is not dict or len(data) != 1:
        raise ProtocolError(f"not a value: {str(data)[:80]}")
    ((tag, body),) = data.items()
    try:
        return _decode_tagged(tag, body, remote_of)
    except (TypeError, ValueError, ArithmeticError, IndexError, KeyError) as err:
        raise ProtocolError(
            f"not a value ({type(err).__name__}: {err}): {str(data)[:80]}"
        ) from None


def _decode_tagged(tag, body, remote_of):
    if tag == "x" and body in ("inf", "-inf", "nan"):
        return float(body)
    if tag in ("t", "s", "f") and type(body) is list:
        items = [decode(v, remote_of) for v in body]
        return {"t": tuple, "s": set, "f": frozenset}[tag](items)
    if tag == "d" and type(body) is list:
        return dict(_decoded_pairs(body, remote_of))
    if tag == "b" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "i" and type(body) is str and body.lstrip("-").isalnum():
        return int(body, 16)
    if tag == "c" and type(body) is list and len(body) == 2:
        return complex(float(decode(body[0])), float(decode(body[1])))
    if tag == "h" and type(body) is int and remote_of is not None:
        return remote_of(body)
    if tag == "std" and type(body) is list and len(body) == 2 and type(body[0]) is str:
        key = tuple(body[0].split(".", 1))
        if key in STD:
            return STD[key][1](body[1], remote_of)
    if tag == "n" and type(body) is list and len(body) == 3:
        name, fields, values = body
        if type(name) is str and all(type(f) is str for f in _list(fields)):
            return _namedtuple(name, fields)(*[decode(v, remote_of) for v in _list(values)])
    if tag in ("e", "dc"):
        return _value(tag, _list(body), remote_of)
    if tag == "v" and type(body) is list and len(body) == 2:
        return _view(body[0], [decode(x, remote_of) for x in _list(body[1])])
    raise ProtocolError(f"not a value: {str({tag: body})[:80]}")


def _view(view, items):
    if view == "keys":
        return dict.fromkeys(items).keys()
    if view == "values":
        return dict(enumerate(items)).values()
    if view == "items":
        return dict(map(tuple, map(_pair, items))).items()
    raise ProtocolError(f"not a dict view: {str(view)[:40]}")


def _value(tag, body, remote_of):
    handle = body[-1]
    remote = remote_of(handle) if remote_of is not None and type(handle) is int else None
    if type(body[0]) is not str:
        raise ProtocolError("a value without a type name")
    if tag == "e" and len(body) == 5 and type(body[1]) is str:
        value = decode(body[2], remote_of)
        mixin = body[3]
        if mixin is not None and (mixin not in ("int", "str", "float") or
                                  type(value).__name__ != mixin):  # fmt: skip
            raise ProtocolError(f"an enum whose value is not its {mixin}")
        base = value if mixin is not None else _NO_BASE
        return Value("enum", body[0], (("name", body[1]), ("value", value)), base, remote)
    if tag == "dc" and len(body) == 3:
        fields = tuple((_str(k), decode(v, remote_of)) for k, v in map(_pair, _list(body[1])))
        return Value("dataclass", body[0], fields, _NO_BASE, remote)
    raise ProtocolError(f"not a value: {str(body)[:80]}")
