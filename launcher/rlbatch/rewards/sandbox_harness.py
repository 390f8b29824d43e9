"""The two sides of a ``test_code`` execution; standard library only (it runs inside the sandbox).

The program and the asserts never share an interpreter. The program runs in its own process
(``python -I -S harness.py program.py``, :func:`serve`): it executes the program as
``__main__`` and then answers requests on file descriptors 3 and 4 (call this function, read this
attribute, iterate this object). The asserts run in another process (:func:`run_asserts`, a fork
of the sandbox's PID 1, never exec'ing anything the program wrote) where every name the program
defined is a stand-in: calling it sends the arguments over a pipe and the answer comes back
as **plain data** rebuilt by this process's own decoder (None, bool, int, float, complex, str,
bytes, list, tuple, dict, set, frozenset). A value of the program that is not plain data comes
back as a :class:`Remote` handle, equal only to itself and without a truth value, so an object
whose ``__eq__`` is always true cannot cross. Whatever the program does to its own interpreter
(exit early, replace ``sys.stdout``, patch builtins, rewrite this module) only changes what it
answers, and the verdict is written by the asserts process, with a per-execution token the
program never sees, on a pipe only that process holds.

Arguments are passed by value: a test that relies on the program mutating an argument in place,
or that passes a function of its own to the program, cannot be run this way (documented).
"""

import builtins
import json
import math
import os
import sys

MAX_MESSAGE = 16 * 1024 * 1024
"""Longest message either side reads (a larger one is a protocol error: the test fails)."""

_PLAIN_SCALARS = (type(None), bool, int, float, str)


class ProtocolError(Exception):
    """The other side sent something that is not a well-formed message."""


class ProgramError(Exception):
    """The program raised an exception that is not a built-in Exception."""


class Shadowed(Exception):
    """The program binds a name the tests take from Python itself (a built-in, a standard
    module): what the tests would call is the program's, so they cannot judge it."""


# ---------------------------------------------------------------- codec (plain data only)


def encode(value, handle_of=None):
    """A JSON-ready form of ``value``; exact built-in types only (a subclass is not plain).
    ``handle_of(obj)`` gives the handle of anything else (None: raise TypeError)."""
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
        return {"d": [[encode(k, handle_of), encode(v, handle_of)] for k, v in value.items()]}
    if kind is set or kind is frozenset:
        return {"s" if kind is set else "f": [encode(v, handle_of) for v in value]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [encode(value.real), encode(value.imag)]}
    if kind is Remote:
        return {"h": value._handle}
    if handle_of is None:
        raise TypeError(f"a {kind.__name__} is not plain data and cannot reach the program")
    return {"h": handle_of(value)}


def decode(data, remote_of=None):
    """The value ``data`` (from :func:`encode`) stands for, built from built-in types only."""
    kind = type(data)
    if kind in _PLAIN_SCALARS:
        return data
    if kind is list:
        return [decode(v, remote_of) for v in data]
    if kind is not dict or len(data) != 1:
        raise ProtocolError(f"not a value: {str(data)[:80]}")
    ((tag, body),) = data.items()
    if tag == "x" and body in ("inf", "-inf", "nan"):
        return float(body)
    if tag in ("t", "s", "f") and type(body) is list:
        items = [decode(v, remote_of) for v in body]
        return {"t": tuple, "s": set, "f": frozenset}[tag](items)
    if tag == "d" and type(body) is list:
        pairs = [(decode(p[0], remote_of), decode(p[1], remote_of)) for p in body]
        return dict(pairs)
    if tag == "b" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "i" and type(body) is str and body.lstrip("-").isalnum():
        return int(body, 16)
    if tag == "c" and type(body) is list and len(body) == 2:
        return complex(float(decode(body[0])), float(decode(body[1])))
    if tag == "h" and type(body) is int and remote_of is not None:
        return remote_of(body)
    raise ProtocolError(f"not a value: {str(data)[:80]}")


class Channel:
    """Newline-delimited JSON messages over a pair of pipe file descriptors."""

    def __init__(self, read_fd, write_fd):
        self.read_fd = read_fd
        self.write_fd = write_fd
        self.buffer = b""

    def send(self, message):
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        while data:
            data = data[os.write(self.write_fd, data) :]

    def receive(self):
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_MESSAGE:
                raise ProtocolError("a message longer than the limit")
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                raise EOFError("the program's process ended")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        try:
            return json.loads(line)
        except (ValueError, RecursionError) as err:
            raise ProtocolError(f"a message that is not JSON ({err})") from None


# ---------------------------------------------------------------- program side


def _exception(err):
    return {"raise": type(err).__name__, "message": str(err)[:500]}


class _Server:
    def __init__(self, channel, namespace):
        self.channel = channel
        self.objects = {}
        self.namespace = namespace

    def handle_of(self, obj):
        key = id(obj)
        self.objects[key] = obj
        return key

    def answer(self, request):
        op = request.get("op")
        target = self.objects.get(request.get("h"))
        if op == "call":
            args = decode(request["args"], self.objects.__getitem__)
            kwargs = decode(request["kwargs"], self.objects.__getitem__)
            return target(*args, **kwargs)
        if op == "getattr":
            return getattr(target, request["name"])
        if op == "iter":
            return iter(target)
        if op == "next":
            return next(target)
        if op == "len":
            return len(target)
        if op == "getitem":
            return target[decode(request["key"], self.objects.__getitem__)]
        if op in ("str", "repr"):
            return str(target) if op == "str" else repr(target)
        raise ValueError(f"unknown request {op!r}")

    def loop(self):
        while True:
            request = self.channel.receive()
            if request.get("op") == "bye":
                return
            try:
                reply = {"ok": encode(self.answer(request), self.handle_of)}
            except Exception as err:  # noqa: BLE001 - the program's own exception: sent back
                reply = _exception(err)
            reply["id"] = request.get("id")
            self.channel.send(reply)


def _manifest(namespace, server):
    names = {}
    modules = {}
    for name, value in list(namespace.items()):
        if name.startswith("__") and name.endswith("__"):
            continue
        if type(value).__name__ == "module":
            modules[name] = getattr(value, "__name__", name)
            continue
        try:
            names[name] = encode(value, server.handle_of)
        except (TypeError, ValueError, RecursionError):
            names[name] = {"h": server.handle_of(value)}
    return {"names": names, "modules": modules}


def serve(program_path, read_fd, write_fd):
    """The program's process: run the program, then answer the asserts' requests (pipes)."""
    import types

    channel = Channel(read_fd, write_fd)
    module = types.ModuleType("__main__")
    module.__file__ = program_path
    sys.modules["__main__"] = module
    sys.argv = [program_path]
    server = _Server(channel, module.__dict__)
    with open(program_path, "rb") as f:
        source = f.read()
    try:
        exec(compile(source, program_path, "exec"), module.__dict__)
    except SystemExit:
        pass  # sys.exit() at the end of a script: its functions are still there to test
    except BaseException as err:  # noqa: BLE001 - reported to the asserts, then exit
        channel.send({"error": f"{type(err).__name__}: {str(err)[:300]}"})
        try:
            import traceback

            traceback.print_exc()
        except OSError:
            pass  # its stderr may be what it filled
        return 1
    try:
        channel.send(_manifest(module.__dict__, server))
        server.loop()
    except (EOFError, OSError):
        pass  # the asserts are done (or gone): nothing left to answer
    return 0


# ---------------------------------------------------------------- asserts side


class Remote:
    """A value of the program that is not plain data: callable, iterable and readable through
    the program, equal only to itself, without a truth value or arithmetic."""

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
        while True:
            try:
                yield self._client.request("next", iterator._handle)
            except StopIteration:
                return

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

    def __bool__(self):
        raise TypeError("a value of the program that is not plain data has no truth value")

    def __setattr__(self, name, value):
        raise TypeError("a value of the program cannot be changed from the tests")


class _Client:
    def __init__(self, channel):
        self.channel = channel
        self.next_id = 0

    def remote(self, handle):
        return Remote(self, handle)

    def request(self, op, handle, **fields):
        self.next_id += 1
        message = {"id": self.next_id, "op": op, "h": handle}
        for key, value in fields.items():
            message[key] = encode(value)
        self.channel.send(message)
        reply = self.channel.receive()
        if type(reply) is not dict or reply.get("id") != self.next_id:
            raise ProtocolError("an answer that does not match the request")
        if "ok" in reply:
            return decode(reply["ok"], self.remote)
        name, message = reply.get("raise"), reply.get("message")
        kind = getattr(builtins, name, None) if type(name) is str else None
        text = message if type(message) is str else ""
        if isinstance(kind, type) and issubclass(kind, Exception):
            raise kind(text)
        raise ProgramError(f"{name}: {text}")


def _taken_from_python(test_code):
    """The names ``test_code`` reads without binding them itself: what it expects from Python
    (built-ins, modules the program imported) or from the program."""
    import ast

    loaded, bound = set(), set()
    for node in ast.walk(ast.parse(test_code)):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound


def _check_shadowing(names, modules, test_code):
    """Shadowed when the program binds a built-in or a standard module the tests read: the
    tests' ``set``, ``sorted`` or ``math.isclose`` would be the program's (an always-true one)."""
    for name in sorted(_taken_from_python(test_code)):
        if name in names and hasattr(builtins, name):
            raise Shadowed(f"the program redefines the built-in {name!r}, which the tests use")
        module = modules.get(name, name) if name not in names else None
        if name in sys.stdlib_module_names and module != name:
            raise Shadowed(
                f"the program binds {name!r}, which the tests use as the standard module,"
                " to something else"
            )


def _globals(client, manifest, test_code):
    import importlib

    if type(manifest) is not dict:
        raise ProtocolError("the program did not say what it defines")
    if "error" in manifest:
        raise ProgramError(f"the program raised {str(manifest['error'])[:300]}")
    modules = manifest.get("modules")
    names = manifest.get("names")
    if type(names) is not dict or type(modules) is not dict:
        raise ProtocolError("the program did not say what it defines")
    for name in (*names, *modules):
        if type(name) is not str or (name.startswith("__") and name.endswith("__")):
            # never sent by serve(): a program that writes its own manifest to replace the
            # tests' __builtins__ (and their __import__) or __name__
            raise ProtocolError(f"the program sent the name {str(name)[:40]!r}")
    _check_shadowing(names, modules, test_code)
    scope = {"__name__": "__main__", "__builtins__": builtins}
    for name, module in modules.items():
        if type(module) is str and module.replace(".", "").replace("_", "").isalnum():
            try:
                scope[name] = importlib.import_module(module)
            except Exception:  # noqa: BLE001, S112 - a module this side lacks: not defined
                continue
    for name, value in names.items():
        scope[name] = decode(value, client.remote)
    return scope


def run_asserts(channel, test_code, token):
    """Run ``test_code`` against the program over ``channel``; the verdict (a dict with the token).
    Kinds: ``assert`` (an assertion failed), ``program`` (the program's process ended or broke
    the protocol before the asserts finished), ``error`` (any other exception)."""
    client = _Client(channel)
    try:
        scope = _globals(client, channel.receive(), test_code)
        exec(compile(test_code, "test_code", "exec"), scope)
    except AssertionError as err:
        return _verdict(token, "assert", f"AssertionError: {err}".rstrip(": "), True)
    except Shadowed as err:
        return _verdict(token, "assert", f"Shadowed: {err}", None)
    except (EOFError, ProtocolError, OSError) as err:
        return _verdict(token, "program", f"{type(err).__name__}: {err}", None)
    except BaseException as err:  # noqa: BLE001 - anything else fails the test, with its reason
        return _verdict(token, "error", f"{type(err).__name__}: {err}", None)
    try:
        channel.send({"op": "bye"})
    except OSError:
        pass
    return {"token": token, "passed": True, "kind": "", "detail": ""}


def _verdict(token, kind, detail, tb):
    line = ""
    if tb:
        import traceback

        frames = [f for f in traceback.extract_tb(sys.exc_info()[2]) if f.filename == "test_code"]
        line = f" (test_code line {frames[-1].lineno})" if frames else ""
    return {"token": token, "passed": False, "kind": kind, "detail": (detail + line)[:500]}


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], 3, 4))
