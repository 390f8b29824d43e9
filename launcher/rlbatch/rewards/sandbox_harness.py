"""The program's side of a ``test_code`` execution; standard library only (it runs inside the
sandbox as ``python -I -S harness.py program.py``).

The program and the asserts never share an interpreter. The program runs in its own process
(:func:`serve`): it executes the program as ``__main__`` and then answers requests on file
descriptors 3 and 4 (call this function, read this attribute, iterate this object), each
answer encoded as data by :mod:`sandbox_codec`. The asserts run in another process
(:mod:`sandbox_asserts`, a fork of the sandbox's PID 1, never exec'ing anything the program
wrote) where every name the program defined is a stand-in. Whatever the program does to its
own interpreter (exit early, replace ``sys.stdout``, patch builtins, rewrite this module) only
changes what it answers, and the verdict is written by the asserts' process, with a
per-execution token the program never sees, on a pipe only that process holds.

A stdin/stdout program runs through this file too (``harness.py --script program.py``), only
so that ``exit()`` and ``quit()``, which ``site`` defines and ``-S`` leaves out, end it as they
end ``python program.py``.

Arguments are passed by value: a test that relies on the program mutating an argument in place,
or that passes a function of its own to the program, cannot be run this way (documented).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    from sandbox_codec import MAX_MESSAGE, ProtocolError, decode, encode
finally:
    del sys.path[0]


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
    """The exception as its type's name and the nearest built-in exception it derives from (a
    program's ``class InvalidInput(ValueError)`` is caught by the tests' ``except ValueError``)."""
    import builtins

    base = next(
        (k.__name__ for k in type(err).__mro__ if getattr(builtins, k.__name__, None) is k), None
    )
    return {"raise": type(err).__name__, "base": base, "message": str(err)[:500]}


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


def add_site_exits():
    """``exit`` and ``quit``, which ``site`` defines and an interpreter run with ``-S`` lacks:
    a script (the program, the tests) that ends with ``exit()`` ends, it does not fail."""
    import builtins

    def _exit(code=None):
        raise SystemExit(code)

    for name in ("exit", "quit"):
        if not hasattr(builtins, name):
            setattr(builtins, name, _exit)


def _main_module(program_path):
    """A fresh ``__main__`` for the program."""
    import types

    module = types.ModuleType("__main__")
    module.__file__ = program_path
    sys.modules["__main__"] = module
    sys.argv = [program_path]
    return module


def _run(module):
    with open(module.__file__, "rb") as f:
        source = f.read()
    exec(compile(source, module.__file__, "exec"), module.__dict__)


def run_script(program_path):
    """A stdin/stdout program, run as ``python program.py`` would run it (with ``exit``)."""
    add_site_exits()
    _run(_main_module(program_path))


def serve(program_path, read_fd, write_fd):
    """The program's process: run the program, then answer the asserts' requests (pipes)."""
    add_site_exits()
    channel = Channel(read_fd, write_fd)
    module = _main_module(program_path)
    server = _Server(channel, module.__dict__)
    try:
        _run(module)
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


if __name__ == "__main__":
    if sys.argv[1] == "--script":
        del sys.argv[1]
        run_script(sys.argv[1])
    else:
        sys.exit(serve(sys.argv[1], 3, 4))
