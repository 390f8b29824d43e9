"""The sandbox itself, through rlbatch.rewards.sandbox.execute: what the program can see and do
(no capability, no token, no dataset), and a wall limit that follows the CPU the program got
rather than the machine's load."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time
import types

import pytest

from rlbatch.config.rewards import Isolation, SandboxLimits
from rlbatch.rewards import sandbox
from rlbatch.rewards.sandbox import Outcome, execute

LIMITS = SandboxLimits(cpu_s=2, wall_s=4)

SNOOP = """import os, re
hexes = set(re.findall('[0-9a-f]{32}', repr(dict(os.environ))))
files = 0
for d, _, names in os.walk('/'):
    for f in names:
        try:
            with open(os.path.join(d, f), 'rb') as fh:
                hexes.update(re.findall(rb'[0-9a-f]{32}', fh.read(1 << 22)))
                files += 1
        except OSError:
            pass
print(files, sorted(h if isinstance(h, str) else h.decode() for h in hexes))
"""


def test_the_program_never_sees_the_executions_token(monkeypatch):
    """The verdict's token is in the host's and PID 1's memory only: a program that reads
    every file it can (its /proc included) and its environment finds it nowhere."""
    token = "feedfacecafebeef0123456789abcdef"
    monkeypatch.setattr(sandbox, "secrets", types.SimpleNamespace(token_hex=lambda n: token))
    run = execute(SNOOP, "", SandboxLimits(cpu_s=20, wall_s=40), Isolation.unshare, "assert True")
    assert run.outcome == Outcome.ok, run  # the verdict needed the token: it was there
    assert int(run.stdout.split()[0]) > 100  # it read the files it could see (its /proc too)
    assert token not in run.stdout


def test_the_program_has_no_capability_and_no_uid_0_as_root():
    program = "import os\nprint(open('/proc/self/status').read())\nprint('uid', os.getuid())"
    run = execute(program, "", LIMITS, Isolation.unshare)
    status = dict(line.split(":\t") for line in run.stdout.splitlines() if ":\t" in line)
    for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[key], 16) == 0, (key, status[key])
    assert status["NoNewPrivs"].strip() == "1"
    assert "uid 0" not in run.stdout  # as root: a fresh unprivileged uid


def test_the_root_holds_only_the_interpreter_and_scratch():
    program = "import os\nfor d, _, fs in os.walk('/'):\n    print(d)"
    run = execute(program, "", LIMITS, Isolation.unshare)
    tops = {line.split("/")[1] for line in run.stdout.splitlines() if line.count("/") >= 1}
    base = sys.base_prefix.split("/")[1]
    assert tops <= {"", ".rlbatch", "tmp", "proc", "dev", "etc", "usr", "lib", "lib64", base}
    base_vars = {"base": sys.base_prefix, "platbase": sys.base_prefix}
    installed = sysconfig.get_paths(vars=base_vars)["purelib"]  # the installation's packages
    assert not [line for line in run.stdout.split() if line.startswith(installed + "/")]
    assert not [line for line in run.stdout.split() if line.startswith(sys.prefix + "/")]
    assert "/proc/1" not in run.stdout.splitlines()  # PID 1 is hidden from the program


def _burners(n: int) -> list[subprocess.Popen]:
    """``n`` busy processes, each in a session of its own: the kernel's autogroup scheduling
    shares the CPUs between sessions, and the sandboxed program runs in one of its own, so
    burners sharing the test's session would compete with it as one process."""
    cmd = [sys.executable, "-c", "while True: pass"]
    return [subprocess.Popen(cmd, start_new_session=True) for _ in range(n)]


def test_a_correct_program_on_a_busy_machine_is_not_a_timeout():
    """1.2 of its 2 CPU-seconds, wall_s=2, beside 3 busy processes per core: it waits for a
    CPU far longer than 2 s, time the wall limit does not count."""
    program = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.2:\n    pass\nprint(5)"
    burners = _burners(3 * (os.cpu_count() or 1))
    try:
        run = execute(program, "", SandboxLimits(cpu_s=2, wall_s=2), Isolation.unshare)
        sleeper = execute("import time\ntime.sleep(60)", "", SandboxLimits(cpu_s=2, wall_s=2),
                          Isolation.unshare)  # fmt: skip
    finally:
        for p in burners:
            p.kill()
            p.wait()
    assert run.outcome == Outcome.ok and run.stdout == "5\n", run
    assert run.wall_s > 2.0  # it did need more wall time than wall_s
    assert sleeper.outcome == Outcome.timeout and sleeper.wall_s < 10  # sleeping still counts


@pytest.mark.parametrize(
    "program, asserts, passed",
    [
        ("def f(x):\n    return [x, (x,), {x: {x}}, b'x', 1.5, None]",
         "assert f(1) == [1, (1,), {1: {1}}, b'x', 1.5, None]", True),
        ("class S:\n    def twice(self, x):\n        return 2 * x\ndef gen(n):\n    yield from range(n)",
         "assert S().twice(4) == 8\nassert list(gen(3)) == [0, 1, 2]", True),
        ("def f(x):\n    raise ValueError(x)",
         "try:\n    f(1)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError", True),
        ("import math\ndef area(r):\n    return math.pi * r * r", "assert math.isclose(area(1), 3.14159, rel_tol=1e-4)", True),
        ("class T(int):\n    def __eq__(self, o):\n        return True\ndef f():\n    return T(0)", "assert f() == 7", False),
        ("def f():\n    return object()", "assert f()", False),
    ],
)  # fmt: skip
def test_plain_data_crosses_and_nothing_else_does(program, asserts, passed):
    run = execute(program, "", LIMITS, Isolation.unshare, asserts)
    assert (run.outcome == Outcome.ok) == passed, run


FORGED_BUILTINS = """def add(a, b):
    return 0
import sys, os
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
sys.path.insert(0, '/.rlbatch')
import harness
class Close:
    def isclose(self, *a, **k):
        return True
close = Close()
def fake_import(*a, **k):
    return close
channel = harness.Channel(3, 4)
server = harness._Server(channel, globals())
builtins_ = {"d": [["__import__", {"h": server.handle_of(fake_import)}]]}
channel.send({"names": {"add": {"h": server.handle_of(add)}, "__builtins__": builtins_},
              "modules": {}})
try:
    server.loop()
except BaseException:
    pass
os._exit(0)
"""


@pytest.mark.parametrize(
    "program, asserts, why",
    [
        ("def common(a, b):\n    return 0\ndef set(x):\n    return 1\ndef sorted(x):\n    return [5, 6]",
         "assert set(common([1, 2, 3], [2, 3, 4])) == set([2, 3])\nassert sorted(common([5, 6], [6, 5])) == [5, 6]",
         "redefines the built-in 'set', which the tests use"),
        ("def area(r):\n    return 0\nclass M:\n    isclose = staticmethod(lambda *a, **k: True)\nmath = M()",
         "assert math.isclose(area(1.0), 3.14159, rel_tol=1e-3)",
         "binds 'math', which the tests use as the standard module"),
        ("import cmath as math\ndef area(r):\n    return 0",
         "assert math.isclose(area(1.0), 3.14159, rel_tol=1e-3)",
         "binds 'math', which the tests use as the standard module"),
        (FORGED_BUILTINS, "import math\nassert math.isclose(add(0.1, 0.2), 0.3)",
         "the program sent the name '__builtins__'"),
    ],
)  # fmt: skip
def test_the_program_cannot_stand_in_for_what_the_tests_take_from_python(program, asserts, why):
    """The asserts' built-ins and standard modules are their own: a wrong program that defines
    ``set``/``sorted``, binds ``math`` to an object whose isclose is always true (tests that use
    math without importing it, as MBPP's do), or forges a ``__builtins__`` whose __import__
    answers ``import math`` in the tests, scored 1.0."""
    run = execute(program, "", LIMITS, Isolation.unshare, asserts)
    assert run.outcome != Outcome.ok, run
    assert why in run.detail, run


@pytest.mark.parametrize(
    "program, asserts",
    [
        ("import math\ndef fact(n):\n    return math.factorial(n)", "import math\nassert fact(2000) == math.factorial(2000)"),
        ("def neg(x):\n    return -x", "assert neg(-(7 ** 9000)) == 7 ** 9000"),
        ("def sorted_(xs):\n    return sorted(xs)\ninput = None", "assert sorted(sorted_([3, 1])) == [1, 3]"),
        ("def set_of(x):\n    return set(x)\nimport math", "import math\nassert set_of([1]) == set([1]) and math.pi > 3"),
    ],
)  # fmt: skip
def test_correct_programs_pass_with_big_ints_and_names_the_tests_do_not_read(program, asserts):
    """Integers past Python's 4,300-digit str limit cross both ways (a correct factorial scored 0:
    the answer could not be written as JSON); a program may define names the tests do not read
    (``input``) and import the modules they do."""
    run = execute(program, "", LIMITS, Isolation.unshare, asserts)
    assert run.outcome == Outcome.ok, run


def test_a_program_cannot_stretch_its_wall_limit_by_starving_itself():
    """Spinners on both cores beside a nice-19 process that waits for a CPU all the time: the
    longest wait of its own processes was taken off the wall limit, so on an idle machine it
    held the worker and every core until the hard ceiling (10 x wall_s; wall_s=10 outlasts
    the watchdog's bound of a batch). The CPU the execution used counts as time it ran; a
    program starved by others (little CPU of its own) still gets its wait taken off."""
    from rlbatch.rewards.sandbox_init import ran_s

    s = 10**9
    hostile = ran_s(20.0, {1: 19.5 * s, 2: 1 * s, 3: 1 * s}, {1: s // 2, 2: 19 * s, 3: 19 * s}, 2)
    assert hostile >= 19.0
    starved = ran_s(20.0, {1: 18 * s}, {1: 2 * s}, 2)
    assert starved == pytest.approx(2.0)
    # time every process was blocked on the disk comes off too, never below the CPU it used
    assert ran_s(20.0, {1: 10 * s}, {1: 2 * s}, 2, stalled=7.0) == pytest.approx(3.0)
    assert ran_s(20.0, {1: 10 * s}, {1: 4 * s}, 1, stalled=9.0) == pytest.approx(4.0)


def test_sleeping_is_not_blocked_on_the_disk():
    """A sleeper (state S) and a spinner (state R) are not stalled by the machine: the wall
    limit keeps counting them."""
    from rlbatch.rewards.sandbox_init import _blocked_on_disk

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)
        assert not _blocked_on_disk([sleeper.pid])
        assert not _blocked_on_disk([os.getpid()])
        assert not _blocked_on_disk([])
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize(
    "program, asserts, outcome, detail",
    [
        ("def add(a, b):\n    return a + b if a > 0 else 0",
         "def test_pos():\n    assert add(1, 2) == 3\n\ndef test_neg():\n    assert add(-1, -2) == -3\n\ndef test_zero():\n    assert add(0, 5) == 5",
         Outcome.wrong_answer, "2 of 3 tests failed (test_neg: AssertionError"),
        ("def add(a, b):\n    return a + b if a > 0 else 0",
         "import unittest\nclass T(unittest.TestCase):\n    def test_pos(self):\n        self.assertEqual(add(1, 2), 3)\n    def test_neg(self):\n        self.assertEqual(add(-1, -2), -3)\nunittest.main()",
         Outcome.wrong_answer, "1 of 2 tests failed (T.test_neg: AssertionError: 0 != -3)"),
        ("print('hello')", "import unittest\nclass T(unittest.TestCase):\n    def test_a(self):\n        self.assertEqual(add(1, 2), 3)\nunittest.main(exit=False)",
         Outcome.crash, "1 of 1 tests failed (T.test_a: NameError: name 'add' is not defined)"),
        ("def add(a, b):\n    return a + b", "def test_cases(a, b):\n    assert add(a, b) == a + b",
         Outcome.crash, "test_cases takes arguments: pytest fixtures and parametrize do not exist here"),
        ("def f(x):\n    raise StopIteration", "assert all(map(f, [1, 2]))\nassert sum(map(f, [1])) == 0",
         Outcome.crash, "the program raised StopIteration () out of call"),
        ("def gen():\n    yield 1", "g = gen()\nassert next(g) == 1\ntry:\n    next(g)\nexcept StopIteration:\n    pass\nelse:\n    raise AssertionError",
         Outcome.ok, ""),
        ("class A:\n    def __ne__(self, o):\n        return True\ndef f():\n    return A()", "assert f() != 3",
         Outcome.crash, "cannot be compared"),
    ],
)  # fmt: skip
def test_the_test_codes_own_tests_run_and_count(program, asserts, outcome, detail):
    """Test functions and TestCase classes are collected and run (they passed any program when
    they were only defined), a StopIteration out of a call is an error (not the end of the
    tests' loop) while next() of a generator still ends, and an object of the program's own
    class refuses to be compared."""
    run = execute(program, "", LIMITS, Isolation.unshare, asserts)
    assert run.outcome == outcome, run
    assert detail in run.detail, run
