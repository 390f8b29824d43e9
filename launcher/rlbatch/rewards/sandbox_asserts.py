"""The asserts' side of a ``test_code`` execution; standard library only (a fork of the
sandbox's PID 1, :mod:`sandbox_init`, that never execs anything the program wrote).

Every name the program defined is a stand-in here: calling it sends the arguments to the
program's process (:mod:`sandbox_harness`) and the answer comes back as data rebuilt by this
process's own decoder (:mod:`sandbox_codec`). The test code runs in a module of its own, then
its tests are collected and run: ``unittest.TestCase`` classes (``unittest.main()`` only marks
where they would have run: it neither exits nor runs them a second time), and, pytest-style,
functions named ``test*`` and the ``test*`` methods of classes named ``Test*`` (defined and never
called: the common shape of a row's tests). Each failing test counts; the verdict names how many
failed of how many and the first failures.

The program's exceptions are raised here as the built-in exception of the same name (or, for its
own exception classes, the built-in one they derive from), except
``StopIteration`` from anything but ``next()``: it would end the tests' own loop over the
program's answers (``all(map(f, cases))``) as if every case had passed, so it is an error.
"""

import builtins
import sys
import types

from sandbox_codec import ProtocolError, Remote, decode, encode
from sandbox_harness import add_site_exits

_ENDS_A_LOOP = ("StopIteration", "StopAsyncIteration")


class ProgramError(Exception):
    """The program raised an exception that is not a built-in Exception, or one that would end
    the tests' loop (StopIteration out of a call)."""


class Shadowed(Exception):
    """The program binds a name the tests take from Python itself (a built-in, a standard
    module): what the tests would call is the program's, so they cannot judge it."""


class TestsFailed(AssertionError):
    """Collected tests (unittest, pytest-style) failed: how many of how many, and the first."""


class TestsErred(Exception):
    """Collected tests raised something other than an assertion (and none failed one)."""


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
        name, base, message = reply.get("raise"), reply.get("base"), reply.get("message")
        kind = _builtin_exception(name) or _builtin_exception(base)
        text = message if type(message) is str else ""
        if op != "next" and (name in _ENDS_A_LOOP or base in _ENDS_A_LOOP):
            raise ProgramError(f"the program raised {name} ({text[:200]}) out of {op}")
        if isinstance(kind, type) and issubclass(kind, Exception):
            raise kind(text)
        raise ProgramError(f"{name}: {text}")


def _builtin_exception(name):
    kind = getattr(builtins, name, None) if type(name) is str else None
    return kind if isinstance(kind, type) and issubclass(kind, BaseException) else None


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
    """The test code's module: the program's names as stand-ins, the standard modules it
    imported as this process's own."""
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
    module = types.ModuleType("__main__")
    sys.modules["__main__"] = module  # unittest's loader and pickle look for it there
    scope = module.__dict__
    scope["__builtins__"] = builtins
    for name, imported in modules.items():
        if type(imported) is str and imported.replace(".", "").replace("_", "").isalnum():
            try:
                scope[name] = importlib.import_module(imported)
            except Exception:  # noqa: BLE001, S112 - a module this side lacks: not defined
                continue
    for name, value in names.items():
        scope[name] = decode(value, client.remote)
    return scope


# ---------------------------------------------------------------- the test code's own tests


def _hold_unittest_main(test_code):
    """``unittest.main()`` in the test code does not run (nor exit): the tests it would have
    found are collected from the test code's module after it ran (:func:`_run_collected`)."""
    if "unittest" not in test_code:
        return
    import unittest

    class _Held:
        def __init__(self, *args, **kwargs):
            self.result = None

    unittest.main = unittest.TestProgram = _Held


def _defined_here(value):
    return getattr(getattr(value, "__code__", None), "co_filename", None) == "test_code"


def _used_names(test_code):
    """The names ``test_code`` reads: a ``test*`` function it calls (or passes on) is a helper
    of its own (``def test(candidate)`` then ``test(add)``), run as the code asked."""
    import ast

    return {
        node.id
        for node in ast.walk(ast.parse(test_code))
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
    }


def _collected(scope, test_code):
    """(name, callable) of every test the test code defined, in definition order: its
    TestCase and ``Test*`` classes (run again if it ran them itself: their results are not
    always checked), its ``test*`` functions that it does not call itself."""
    tests = []
    unittest = sys.modules.get("unittest")
    used = _used_names(test_code)
    for name, value in list(scope.items()):
        if type(value) is types.FunctionType and name.startswith("test") and _defined_here(value):
            if name not in used:
                tests.append((name, value))
        elif isinstance(value, type) and value.__module__ == "__main__":
            if unittest is not None and issubclass(value, unittest.TestCase):
                loaded = unittest.defaultTestLoader.loadTestsFromTestCase(value)
                tests += [(t.id().removeprefix("__main__."), t) for t in loaded]
            elif name.startswith("Test"):
                tests += _pytest_methods(name, value)
    return tests


def _pytest_methods(name, cls):
    import functools

    methods = [m for m in vars(cls) if m.startswith("test") and callable(vars(cls)[m])]
    return [(f"{name}.{m}", functools.partial(_run_method, cls, m)) for m in methods]


def _run_method(cls, name):
    """One test method of a pytest-style class, on a fresh instance, between the class's
    ``setup_method`` and ``teardown_method`` as pytest calls them."""
    instance = cls()
    method = getattr(instance, name)
    refused = _takes_arguments(method, name)
    if refused is not None:
        raise refused
    setup = getattr(instance, "setup_method", None)
    if setup is not None:
        setup(method)
    try:
        _check_ran(method(), name)
    finally:
        teardown = getattr(instance, "teardown_method", None)
        if teardown is not None:
            teardown(method)


def _takes_arguments(test, name):
    """The error for a test that needs arguments (None: it needs none)."""
    import inspect

    required = [
        p
        for p in inspect.signature(test).parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if not required:
        return None
    return TypeError(
        f"{name} takes arguments: pytest fixtures and parametrize do not exist here; write the"
        " cases inside the test"
    )


def _check_ran(result, name):
    """A test that is a coroutine or a generator ran none of its body: an error, not a pass."""
    import inspect

    if inspect.iscoroutine(result) or inspect.isgenerator(result):
        result.close()
        raise TypeError(f"{name} is async or a generator: its body never runs here")


def _run_one(test):
    """The exception a test ended with (None: it passed)."""
    unittest = sys.modules.get("unittest")
    if unittest is not None and isinstance(test, unittest.TestCase):
        result = unittest.TestResult()
        test.run(result)
        bad = result.errors + result.failures + [(t, "unexpected success")
                                                 for t in result.unexpectedSuccesses]  # fmt: skip
        return _FromUnittest(bad[0][1]) if bad else None
    if type(test) is types.FunctionType:
        refused = _takes_arguments(test, test.__name__)
        if refused is not None:
            return refused
    try:
        _check_ran(test(), getattr(test, "__name__", "the test"))
    except (EOFError, ProtocolError, OSError):
        raise  # the program's process is gone: that is the verdict
    except Exception as err:  # noqa: BLE001 - the test's failure, counted
        return err
    return None


class _FromUnittest(Exception):
    """A unittest failure or error, as unittest formatted it (its traceback's last line)."""

    def __init__(self, text):
        lines = [line for line in str(text).strip().splitlines() if line.strip()]
        super().__init__(lines[-1] if lines else str(text))
        self.is_assertion = bool(lines) and lines[-1].startswith(("AssertionError", "Tests"))


def _run_collected(scope, test_code):
    """Run every collected test; raise TestsFailed / TestsErred naming how many failed."""
    tests = _collected(scope, test_code)
    failed = [(name, err) for name, test in tests if (err := _run_one(test)) is not None]
    if not failed:
        return
    asserted = all(
        isinstance(e, AssertionError) or getattr(e, "is_assertion", False) for _, e in failed
    )
    first = "; ".join(f"{name}: {_described(e)}"[:200] for name, e in failed[:3])
    text = f"{len(failed)} of {len(tests)} tests failed ({first})"
    raise TestsFailed(text) if asserted else TestsErred(text)


def _described(err):
    return str(err) if type(err) is _FromUnittest else f"{type(err).__name__}: {err}".rstrip(": ")


def _exec_test_code(test_code, scope):
    """Run the test code's module. ``sys.exit(0)`` (or ``exit()``) ends it as a script's end
    does, and its tests are still collected; any other status is the tests' failure."""
    try:
        exec(compile(test_code, "test_code", "exec"), scope)
    except SystemExit as err:
        if err.code not in (None, 0):
            raise TestsFailed(f"the test code exited with status {err.code!r}") from None


def run_asserts(channel, test_code, token):
    """Run ``test_code`` against the program over ``channel``; the verdict (a dict with the token).
    Kinds: ``assert`` (an assertion failed), ``program`` (the program's process ended or broke
    the protocol before the asserts finished), ``error`` (any other exception)."""
    client = _Client(channel)
    add_site_exits()
    try:
        _hold_unittest_main(test_code)
        scope = _globals(client, channel.receive(), test_code)
        _exec_test_code(test_code, scope)
        _run_collected(scope, test_code)
    except TestsFailed as err:
        return _verdict(token, "assert", f"TestsFailed: {err}", None)
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
