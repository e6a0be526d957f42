"""The code the grader runs inside a workspace to learn each test's outcome: a supervisor, and a
reporter loaded into the test process before the code under test. Standard library only, for
any Python >= 3.6 that a task's environment holds; `grading` ships this file's text as
`python -c` (nothing of it is written into the workspace). See docs/swe-grading.md.

    python3 -c SRC supervise  # stdin: {"key": hex, "command": str, "runs": n, "write": {}}
    python -c SRC report unittest ARGS...  # in place of `python -m unittest ARGS...`
    python -c SRC report pytest ARGS...    # in place of `python -m pytest ARGS...` / `pytest`

The supervisor makes itself non-dumpable (no ptrace, no /proc/PID/mem or /fd for processes of
its uid), reads its key from stdin (the test command gets /dev/null), writes the files of
`write` (the test module with the grader's canaries), and runs the test command in a session of
its own with the write end of a pipe in `SAO_REPORT_FD`. Each reporter writes one JSON line per
finished test to that pipe (`{"test": id, "outcome": PASSED|FAILED|ERROR|SKIPPED}`), never to
stdout, `{"tamper": name}` when it finds (after each test) that a function of the framework, of
the reporter or of a few builtins it remembered before the run was replaced, and
`{"done": testsRun}` once the runner has returned. When `runs` runners are done (or the command
ended), the supervisor SIGKILLs the session, then prints one line
`MARK base64(zlib(payload)) hmac-sha256(key, zlib(payload))`: every record in arrival order, how
many runs finished, the names reported replaced, the lines on the pipe that were not records,
and the command's exit status (None when it was killed). The grader trusts only that line.
"""

import base64
import json
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
    import hmac
    import select
    import signal
    import subprocess
    import zlib

    dumpable_off = _undumpable()
    spec = json.loads(sys.stdin.buffer.read().decode())
    key, runs = bytes.fromhex(spec["key"]), int(spec["runs"])
    for path, text in spec.get("write", {}).items():  # the test module with its canaries
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    read_fd, write_fd = os.pipe()
    env = dict(os.environ, SAO_REPORT_FD=str(write_fd))
    proc = subprocess.Popen(["bash", "-c", spec["command"]], stdin=subprocess.DEVNULL,
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


class _Channel:
    def __init__(self):
        self.fd = int(os.environ.pop("SAO_REPORT_FD"))
        self.write = os.write  # bound now, before the code under test runs
        self.watched = []  # (label, namespace, {name: value}) as they were before the run
        self.told = set()

    def send(self, record):
        data = (json.dumps(record) + "\n").encode()
        while data:
            data = data[self.write(self.fd, data):]

    def watch(self, label, owner, names=None):
        """Remembers the attributes of `owner` (a class, module or object; `names`, or every
        function and class it defines) so that `check` can tell when one was replaced."""
        space = vars(owner)
        if names is None:
            names = [k for k, v in space.items()
                     if isinstance(v, (type, staticmethod, classmethod, property))
                     or callable(v) and hasattr(v, "__code__")]
        self.watched.append((label, space, {k: space.get(k, _MISSING) for k in names}))

    def check(self):
        """Sends a {"tamper": name} record for each watched attribute replaced since `watch`."""
        for label, space, before in self.watched:
            for name, value in before.items():
                if space.get(name, _MISSING) is not value and label + "." + name not in self.told:
                    self.told.add(label + "." + name)
                    self.send({"tamper": label + "." + name})


_BUILTINS = ("AssertionError", "BaseException", "Exception", "isinstance", "issubclass", "type",
             "getattr", "setattr", "len", "repr", "str", "int", "list", "dict", "tuple", "bool",
             "sorted", "sum", "divmod", "range", "callable", "super", "object")


def _watch_common(channel):
    import builtins
    import unittest

    channel.watch("builtins", builtins, _BUILTINS)
    channel.watch("os", os, ["write", "_exit", "kill"])
    channel.watch("json", json, ["dumps"])
    for cls in (unittest.TestCase, unittest.TestResult, unittest.TextTestResult,
                unittest.TestSuite, unittest.suite.BaseTestSuite, unittest.TestLoader,
                getattr(unittest.case, "_Outcome", object), _Channel):
        channel.watch(cls.__module__ + "." + cls.__name__, cls)
    channel.watch("channel", channel, ["write", "fd", "send", "check"])


def report_unittest(channel, args):
    import unittest

    class Result(unittest.TextTestResult):
        """TextTestResult that also sends each test's worst outcome when it stops."""

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self._worst = {}

        def _note(self, test, outcome):
            test_id = test.id()
            if SEVERITY[outcome] >= SEVERITY[self._worst.get(test_id, PASSED)]:
                self._worst[test_id] = outcome

        def startTest(self, test):
            super().startTest(test)
            self._worst.pop(test.id(), None)

        def stopTest(self, test):
            super().stopTest(test)
            channel.send({"test": test.id(), "outcome": self._worst.pop(test.id(), ERROR)})
            channel.check()

        def addSuccess(self, test):
            super().addSuccess(test)
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
            self._note(test, PASSED)

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
    """assertEqual fails on an object of the repository's own code that claims to equal a
    private sentinel: a value that compares equal to anything proves nothing."""
    cwd = os.path.realpath(os.getcwd()) + os.sep
    base = unittest.TestCase._baseAssertEqual
    getter = unittest.TestCase._getAssertEqualityFunc

    class Sentinel:
        pass

    def from_repository(value):  # and not from its tests, whose helpers may match anything
        module = sys.modules.get(type(value).__module__)
        path = os.path.realpath(getattr(module, "__file__", None) or "")
        parts = path[len(cwd):].lower().split(os.sep)
        in_tests = (any(p in ("test", "tests", "testing") for p in parts[:-1])
                    or parts[-1].startswith("test_") or parts[-1].endswith("_test.py")
                    or parts[-1] == "conftest.py")
        return path.startswith(cwd) and not in_tests

    def claims_anything(value):
        if not from_repository(value):
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


def report_pytest(channel, args):
    import pytest

    class Plugin:
        """Sends each test's worst phase outcome at its teardown report (the last phase)."""

        def __init__(self):
            self.worst = {}

        def pytest_runtest_logreport(self, report):
            outcome = _pytest_outcome(report)
            test_id = report.nodeid
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


def _pytest_outcome(report):
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if report.passed:
            return FAILED if xfail else PASSED  # an unexpected pass of an xfail
        if report.skipped:
            return PASSED if xfail else SKIPPED
        return FAILED
    if report.failed:
        return ERROR
    if report.skipped:
        return PASSED if xfail else SKIPPED
    return PASSED


def report(framework, args):
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
