"""The code the grader runs inside a workspace to learn each test's outcome: a supervisor, and a
reporter loaded into the test process before the code under test. Standard library only, for
any Python >= 3.6 that a task's environment holds; `grading` ships this file's text as
`python -c` (nothing of it is written into the workspace). See docs/swe-grading.md.

    cd / && python3 -I -c SRC supervise
        # stdin: {"key": hex, "root": dir, "command": str, "runs": n, "write": {}}
    python -c SRC report unittest ARGS...  # in place of `python -m unittest ARGS...`
    python -c SRC report pytest ARGS...    # in place of `python -m pytest ARGS...` / `pytest`

Nothing of the repository reaches the supervisor: it runs in isolated mode (`-I`: no PYTHON*
variables, no user site, no script directory on sys.path) from `/`, and imports every module it
needs before it reads its spec. The reporter must run in the repository (the runner imports the
tests from there), so it imports its own modules and the framework's first, with every path of
the repository taken off sys.path meanwhile (`_import_outside`): a module a patch adds under a
standard name cannot stand in for them.

The supervisor makes itself non-dumpable (no ptrace, no /proc/PID/mem or /fd for processes of
its uid), reads its key from stdin (the test command gets /dev/null), writes the files of
`write` (the test module with the grader's canaries; paths relative to `root`), and runs the
test command at `root` in a session of its own with the write end of a pipe in
`SAO_REPORT_FD`. Each reporter writes one JSON line per finished test to that pipe
(`{"test": id, "outcome": PASSED|FAILED|ERROR|SKIPPED}`), never to stdout, `{"tamper": name}`
when it finds (after each test) that a function of the framework, of the reporter or of a few
builtins it remembered before the run was replaced, and
`{"done": testsRun}` once the runner has returned. The reporter also checks, after each test,
what the code under test could change without replacing a function: that the report descriptor
still points to the supervisor's pipe (else it exits at once, before `done`), that no trace or
profile function of the repository's code is set, that the running test kept the id, the class
and method, and the expected-failure mark it started with, and that neither the test nor the
runner's result object holds functions of its own in place of its class's. When `runs`
runners are done (or the command ended), the supervisor SIGKILLs the session, then prints one
line
`MARK base64(zlib(payload)) hmac-sha256(key, zlib(payload))`: every record in arrival order, how
many runs finished, the names reported replaced, the lines on the pipe that were not records,
and the command's exit status (None when it was killed). The grader trusts only that line.
"""

import os
import sys

MARK = "SAO_GRADER_VERDICT"
PASSED, FAILED, ERROR, SKIPPED = "PASSED", "FAILED", "ERROR", "SKIPPED"
SEVERITY = {PASSED: 0, SKIPPED: 1, FAILED: 2, ERROR: 3}
MAX_LINE = 1 << 16  # bytes of one record line; longer ones are not records
MAX_RECORDS = 1 << 20


# ----------------------------------------------------------------------------- supervisor


def _undumpable():
    """prctl(PR_SET_DUMPABLE, 0): processes of this uid can no longer ptrace this one or read
    its /proc/PID/mem, environ or fd. True when it took."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0
    except (OSError, AttributeError, ImportError):
        return False


def supervise():
    import base64
    import hmac
    import json
    import select
    import signal
    import subprocess
    import zlib

    dumpable_off = _undumpable()
    spec = json.loads(sys.stdin.buffer.read().decode())
    key, runs, root = bytes.fromhex(spec["key"]), int(spec["runs"]), spec["root"]
    for path, text in spec.get("write", {}).items():  # the test module with its canaries
        with open(os.path.join(root, path), "w", encoding="utf-8") as f:
            f.write(text)
    read_fd, write_fd = os.pipe()
    env = dict(os.environ, SAO_REPORT_FD=str(write_fd))
    proc = subprocess.Popen(["bash", "-c", spec["command"]], stdin=subprocess.DEVNULL, cwd=root,
                            pass_fds=(write_fd,), start_new_session=True, env=env)
    os.close(write_fd)
    records, tampered, garbled, done, buffer = [], [], 0, 0, b""
    exited = False
    while done < runs and len(records) < MAX_RECORDS:
        ready = select.select([read_fd], [], [], 0.05)[0]
        if not ready:
            if exited:  # the command is over and nothing more came within the poll
                break
            exited = proc.poll() is not None
            continue
        chunk = os.read(read_fd, 1 << 16)
        if not chunk:
            break
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        if len(buffer) > MAX_LINE:
            garbled, buffer = garbled + 1, b""
        for line in lines:
            record = _record(line)
            if record is None:
                garbled += 1
            elif "done" in record:
                done += 1
            elif "tamper" in record:
                tampered.append(record["tamper"])
            else:
                records.append([record["test"], record["outcome"]])
    try:  # the reports are in: nothing of the run goes on (children that left the session
        os.killpg(proc.pid, signal.SIGKILL)  # die with the workspace's command)
    except OSError:
        pass
    returncode = proc.wait()
    payload = json.dumps({"records": records, "done": done, "garbled": garbled + bool(buffer),
                          "tampered": tampered[:100],
                          "exit": returncode if returncode >= 0 else None,
                          "undumpable": dumpable_off}).encode()
    payload = zlib.compress(payload, 6)  # test ids compress well: big suites stay small
    mac = hmac.new(key, payload, "sha256").hexdigest()
    line = f"\n{MARK} {base64.b64encode(payload).decode()} {mac}\n"
    data = line.encode()
    while data:
        data = data[os.write(1, data):]
    os._exit(0)


def _record(line):
    import json

    if len(line) > MAX_LINE:
        return None
    try:
        record = json.loads(line.decode())
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    if set(record) == {"done"} and isinstance(record["done"], int):
        return record
    if set(record) == {"tamper"} and isinstance(record["tamper"], str):
        return record
    if (set(record) == {"test", "outcome"} and isinstance(record["test"], str)
            and record["outcome"] in SEVERITY):
        return record
    return None


# ----------------------------------------------------------------------------- reporter


_MISSING = object()


def _import_outside(names, optional=()):
    """Imports `names` (then `optional`, where they import) with every path of the repository
    (the working directory, and any entry of sys.path under it) off sys.path, which is restored
    after: a module or package that a patch adds under one of these names, at the root or on
    a PYTHONPATH entry of the repository, is never the one imported. A name of `optional` that
    only the repository holds (the repository is that framework: pytest's own) is imported from
    there."""
    here = os.path.realpath(os.getcwd())
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if not _is_within(os.path.realpath(p or "."), here)]
    try:
        for name in names:
            __import__(name)
        outside_only = []
        for name in optional:
            try:
                __import__(name)
            except ImportError:
                outside_only.append(name)
    finally:
        sys.path[:] = saved
    for name in outside_only:
        try:
            __import__(name)
        except ImportError:
            pass


def _is_within(path, root):
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _repository_part(path):
    """"source" or "tests" for a file of the repository (the working directory), else None."""
    cwd = os.path.realpath(os.getcwd())
    path = os.path.realpath(path or "")
    if not _is_within(path, cwd) or path == cwd:
        return None
    parts = path[len(cwd) + 1:].lower().split(os.sep)
    in_tests = (any(p in ("test", "tests", "testing") for p in parts[:-1])
                or parts[-1].startswith("test_") or parts[-1].endswith("_test.py")
                or parts[-1] == "conftest.py")
    return "tests" if in_tests else "source"


def _code_file(function):
    code = getattr(function, "__code__", None)
    if code is None:  # an object with a __call__ method
        code = getattr(vars(type(function)).get("__call__"), "__code__", None)
    return getattr(code, "co_filename", None)


class _Channel:
    def __init__(self):
        import json

        self.fd = int(os.environ.pop("SAO_REPORT_FD"))
        # bound now, before the code under test runs
        self.write, self.fstat, self.exit, self.dumps = os.write, os.fstat, os._exit, json.dumps
        self.gettrace, self.getprofile = sys.gettrace, sys.getprofile
        self.pipe = self._identity()
        self.watched = []  # (label, namespace, {name: value}) as they were before the run
        self.instances = []  # (label, object, names of its own attributes before the run)
        self.told = set()

    def _identity(self):
        try:
            stat = self.fstat(self.fd)
        except OSError:
            return None
        return stat.st_dev, stat.st_ino

    def send(self, record):
        data = (self.dumps(record) + "\n").encode()
        while data:
            data = data[self.write(self.fd, data):]

    def tamper(self, name):
        if name not in self.told:
            self.told.add(name)
            self.send({"tamper": name})

    def watch(self, label, owner, names=None):
        """Remembers the attributes of `owner` (a class, module or object; `names`, or every
        function and class it defines) so that `check` can tell when one was replaced."""
        space = vars(owner)
        if names is None:
            names = [k for k, v in space.items()
                     if isinstance(v, (type, staticmethod, classmethod, property))
                     or callable(v) and hasattr(v, "__code__")]
        self.watched.append((label, space, {k: space.get(k, _MISSING) for k in names}))

    def watch_instance(self, label, obj):
        """Remembers which attributes `obj` holds itself, so that `check` can tell when one of
        its class's functions is shadowed by an attribute of the object."""
        self.instances.append((label, obj, set(vars(obj))))

    def check(self):
        """Sends a {"tamper": name} record for each watched attribute replaced since `watch`, each
        function shadowed on a watched object, and a trace or profile function of the
        repository's source; exits at once (before `done`) when the report descriptor no longer
        points to the supervisor's pipe, since nothing sent there reaches it."""
        if self._identity() != self.pipe:
            self.exit(70)
        for label, space, before in self.watched:
            for name, value in before.items():
                if space.get(name, _MISSING) is not value:
                    self.tamper(label + "." + name)
        for label, obj, before in self.instances:
            for name in shadowing(obj, before):
                self.tamper(f"{label}.{name} (set on the object)")
        for label, hook in (("sys.settrace", self.gettrace()), ("sys.setprofile",
                                                                 self.getprofile())):
            if hook is not None and _repository_part(_code_file(hook)) == "source":
                self.tamper(f"{label} ({_code_file(hook)})")


def shadowing(obj, before=()):
    """Attributes of `obj` itself, beyond `before`, that stand in for a function of its class."""
    cls = type(obj)
    return [name for name, value in list(vars(obj).items())
            if name not in before and callable(value) and callable(getattr(cls, name, None))]


_BUILTINS = ("AssertionError", "BaseException", "Exception", "isinstance", "issubclass", "type",
             "getattr", "setattr", "len", "repr", "str", "int", "list", "dict", "tuple", "bool",
             "sorted", "sum", "divmod", "range", "callable", "super", "object", "vars")


def _watch_common(channel):
    import builtins
    import json
    import unittest

    channel.watch("builtins", builtins, _BUILTINS)
    channel.watch("os", os, ["write", "_exit", "kill", "fstat"])
    channel.watch("sys", sys, ["gettrace", "getprofile"])
    channel.watch("json", json, ["dumps"])
    for cls in (unittest.TestCase, unittest.TestResult, unittest.TextTestResult,
                unittest.TestSuite, unittest.suite.BaseTestSuite, unittest.TestLoader,
                getattr(unittest.case, "_Outcome", object), _Channel):
        channel.watch(cls.__module__ + "." + cls.__name__, cls)
    channel.watch("channel", channel, ["write", "fd", "send", "check", "tamper", "pipe",
                                       "fstat", "exit", "dumps", "gettrace", "getprofile"])


def _declared_expected_failure(test):
    """Whether `test` (a TestCase) is marked to fail, as unittest reads the mark, from its class."""
    method = getattr(type(test), getattr(test, "_testMethodName", ""), None)
    return bool(getattr(type(test), "__unittest_expecting_failure__", False)
                or getattr(method, "__unittest_expecting_failure__", False))


def _test_id(test):
    """The id of `test` from its class and method (what `TestCase.id` gives unless a class
    defines its own), read before the test runs."""
    import unittest

    if isinstance(test, unittest.TestCase) and type(test).id is unittest.TestCase.id:
        cls = type(test)
        return f"{cls.__module__}.{cls.__qualname__}.{test._testMethodName}"
    return test.id()


def report_unittest(channel, args):
    import unittest

    class Result(unittest.TextTestResult):
        """TextTestResult that also sends each test's worst outcome when it stops, under the id
        the test had when it started."""

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self._worst = {}
            self._running = {}  # id(test) -> (test id, expected failure declared, own attrs)
            channel.watch_instance("the runner's result", self)

        def _id(self, test):
            state = self._running.get(id(test))
            return state[0] if state else test.id()

        def _note(self, test, outcome):
            test_id = self._id(test)
            if SEVERITY[outcome] >= SEVERITY[self._worst.get(test_id, PASSED)]:
                self._worst[test_id] = outcome

        def startTest(self, test):
            test_id = _test_id(test)
            if self._running:
                channel.tamper(f"startTest of {test_id} while another test runs")
            self._running[id(test)] = (test_id, _declared_expected_failure(test),
                                       set(vars(test)))
            super().startTest(test)
            self._worst.pop(test_id, None)

        def stopTest(self, test):
            super().stopTest(test)
            state = self._running.pop(id(test), None)
            if state is None:
                channel.tamper(f"stopTest of {test.id()}, which did not start")
                return
            test_id, _, own = state
            for name in shadowing(test, own):
                channel.tamper(f"{test_id}: {name} set on the running test")
            channel.send({"test": test_id, "outcome": self._worst.pop(test_id, ERROR)})
            channel.check()

        def addSuccess(self, test):
            super().addSuccess(test)
            state = self._running.get(id(test))
            outcome = getattr(test, "_outcome", None)
            if (state is not None and not state[1] and outcome is not None
                    and getattr(outcome, "expectedFailure", None) is not None):
                # unittest keeps a failure aside when the test is marked to fail while it runs
                channel.tamper(f"{state[0]}: expected to fail, not marked so at its start")
                self._note(test, FAILED)
                return
            self._note(test, PASSED)

        def addFailure(self, test, err):
            super().addFailure(test, err)
            self._note(test, FAILED)

        def addError(self, test, err):
            super().addError(test, err)
            if isinstance(test, unittest.TestCase):
                self._note(test, ERROR)
            else:  # setUpClass / setUpModule failures: no startTest, no stopTest
                channel.send({"test": str(test), "outcome": ERROR})

        def addSkip(self, test, reason):
            super().addSkip(test, reason)
            self._note(test, SKIPPED)

        def addExpectedFailure(self, test, err):
            super().addExpectedFailure(test, err)
            state = self._running.get(id(test))
            if state is not None and state[1]:
                self._note(test, PASSED)
            else:  # marked while it ran: a failure that the code under test excused
                channel.tamper(f"{self._id(test)}: expected to fail, not marked so at its start")
                self._note(test, FAILED)

        def addUnexpectedSuccess(self, test):
            super().addUnexpectedSuccess(test)
            self._note(test, FAILED)

        def addSubTest(self, test, subtest, err):
            super().addSubTest(test, subtest, err)
            if err is not None:
                failure = issubclass(err[0], test.failureException)
                self._note(test, FAILED if failure else ERROR)

    class Runner(unittest.TextTestRunner):
        resultclass = Result

    _guard_equality(unittest)
    _watch_common(channel)
    channel.watch("Result", Result)
    channel.watch("Runner", Runner)
    program = unittest.main(module=None, argv=["python -m unittest"] + args, testRunner=Runner,
                            exit=False)
    return program.result.testsRun


def _guard_equality(unittest):
    """assertEqual fails on a value whose `__eq__` is the repository's own code (not its tests')
    and that claims to equal a private sentinel: a value that compares equal to anything proves
    nothing. Where `__eq__` is defined is read from its code, not from the class's `__module__`,
    which any class may set."""
    base = unittest.TestCase._baseAssertEqual
    getter = unittest.TestCase._getAssertEqualityFunc

    class Sentinel:
        pass

    def claims_anything(value):
        if _repository_part(_code_file(type(value).__eq__)) != "source":
            return False
        try:
            return bool(value == Sentinel())
        except Exception:
            return False

    def check(first, second):
        for value in (first, second):
            if claims_anything(value):
                raise unittest.TestCase.failureException(
                    f"{type(value).__module__}.{type(value).__qualname__} compares equal to "
                    "anything")

    def checked_base(self, first, second, msg=None):
        check(first, second)
        return base(self, first, second, msg)

    def checked_getter(self, first, second):
        check(first, second)
        return getter(self, first, second)

    unittest.TestCase._baseAssertEqual = checked_base
    unittest.TestCase._getAssertEqualityFunc = checked_getter


_PYTEST_MODULES = ("pytest", "_pytest.assertion.rewrite", "_pytest.python", "_pytest.reports",
                   "_pytest.runner")


def report_pytest(channel, args):
    import pytest

    class Plugin:
        """Sends each test's worst phase outcome at its teardown report (the last phase), under
        the node id the test had when its protocol started; an xfail counts as a pass only for
        a test marked xfail at that start."""

        def __init__(self):
            self.worst = {}
            self.running = None  # (node id, xfail marked) of the test whose protocol runs

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_protocol(self, item, nextitem):
            self.running = (item.nodeid, item.get_closest_marker("xfail") is not None)

        def pytest_runtest_logreport(self, report):
            test_id, marked = self.running or (report.nodeid, False)
            if report.nodeid != test_id:
                channel.tamper(f"a report of {report.nodeid!r} while {test_id!r} runs")
            outcome = _pytest_outcome(report, marked)
            if SEVERITY[outcome] >= SEVERITY[self.worst.get(test_id, PASSED)]:
                self.worst[test_id] = outcome
            if report.when == "teardown":
                channel.send({"test": test_id, "outcome": self.worst.pop(test_id)})
                channel.check()

        def pytest_collectreport(self, report):
            if report.failed:
                channel.send({"test": report.nodeid or "<collection>", "outcome": ERROR})

    import _pytest.assertion.rewrite
    import _pytest.python
    import _pytest.reports
    import _pytest.runner

    _watch_common(channel)
    for owner in (Plugin, _pytest.reports.TestReport, _pytest.reports.BaseReport,
                  _pytest.runner.CallInfo, _pytest.python.Function, _pytest.runner,
                  _pytest.assertion.rewrite.AssertionRewritingHook,
                  _pytest.assertion.rewrite.AssertionRewriter):
        channel.watch(getattr(owner, "__qualname__", owner.__name__), owner)
    channel.watch("_pytest.python", _pytest.python, ["pytest_pyfunc_call"])
    channel.watch("_pytest.assertion.rewrite", _pytest.assertion.rewrite, ["rewrite_asserts"])
    pytest.main(args, plugins=[Plugin()])
    return -1


def _pytest_outcome(report, xfail_marked):
    """The outcome of one phase's report; an xfail (skipped with `wasxfail`) passes only for a
    test marked xfail when it started (a `pytest.xfail()` call at run time is a skip)."""
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if report.passed:
            return FAILED if xfail else PASSED  # an unexpected pass of an xfail
        if report.skipped:
            return PASSED if xfail and xfail_marked else SKIPPED
        return FAILED
    if report.failed:
        return ERROR
    if report.skipped:
        return PASSED if xfail and xfail_marked else SKIPPED
    return PASSED


# What the reporter and the runners import, at once or later on the way (argparse imports
# shutil, which imports zlib, when unittest parses its arguments ...).
_REPORTER_MODULES = ("json", "unittest", "unittest.case", "unittest.main", "argparse", "shutil",
                     "zlib", "bz2", "lzma", "traceback", "linecache", "difflib", "pprint",
                     "fnmatch", "inspect", "tempfile", "signal", "warnings", "gettext",
                     "locale", "importlib.util", "importlib.machinery")


def report(framework, args):
    optional = _PYTEST_MODULES if framework == "pytest" else ()
    _import_outside(_REPORTER_MODULES, optional)
    channel = _Channel()
    sys.argv = [framework] + args
    ran = (report_unittest if framework == "unittest" else report_pytest)(channel, args)
    channel.check()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    channel.send({"done": ran})
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "supervise":
        supervise()
    elif sys.argv[1] == "report" and sys.argv[2] in ("unittest", "pytest"):
        report(sys.argv[2], sys.argv[3:])
    else:
        sys.exit("usage: python -c SRC supervise | report unittest|pytest ARGS...")
