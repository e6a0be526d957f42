"""Canaries planted into small test modules, then run: the must-pass one passes and the must-fail
one fails, whichever names, places, donors and literals the random draw picked."""

import random
import types
import unittest

import pytest

from sao_jax.envs.swe.canaries import module_candidates, plant

UNITTEST_MODULE = '''\
import unittest


def double(x):
    return 2 * x


class TestDouble(unittest.TestCase):
    def test_one(self):
        """Docstring."""
        self.assertEqual(double(1), 2)

    def test_words(self):
        self.assertEqual(double("ab"), "abab")

    @unittest.skip("no")
    def test_skipped(self):
        self.assertEqual(double(3), 6)
'''

PYTEST_MODULE = '''\
def double(x):
    return 2 * x


def test_one():
    assert double(1) == 2


def test_list():
    assert double([1]) == [1, 1]
'''


def run_unittest(text):
    module = types.ModuleType("m")
    exec(compile(text, "m.py", "exec"), module.__dict__)
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    ran = {t.id() for t in _tests(suite)}  # a suite drops its tests as it runs them
    result = unittest.TestResult()
    suite.run(result)
    failed = {t.id() for t, _ in result.failures + result.errors}
    return ran - failed, failed


def _tests(suite):
    for item in suite:
        yield from (_tests(item) if isinstance(item, unittest.TestSuite) else [item])


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("passing", [("m.TestDouble.test_one", "m.TestDouble.test_words"), ()],
                         ids=["copies", "templates"])
def test_unittest_canaries_pass_and_fail_as_planted(seed, passing):
    text, pair = plant(UNITTEST_MODULE, "m.py", "m.TestDouble.test_one", "unittest",
                       passing=passing, rng=random.Random(seed))
    assert pair.must_pass.startswith("m.TestDouble.test_") and pair.must_pass != pair.must_fail
    passed, failed = run_unittest(text)
    assert pair.must_pass in passed and pair.must_fail in failed
    assert failed == {pair.must_fail}  # the module's own tests are untouched
    if passing:  # a copy of a passing test: it runs the code under test too
        assert "double(" in text.split("def " + pair.must_fail.rsplit(".", 1)[1])[1][:200]


@pytest.mark.parametrize("seed", range(10))
def test_pytest_canaries_at_top_level(seed):
    passing = ("m.py::test_one", "m.py::test_list")
    text, pair = plant(PYTEST_MODULE, "m.py", "m.py::test_one", "pytest", passing=passing,
                       rng=random.Random(seed))
    namespace = {}
    exec(compile(text, "m.py", "exec"), namespace)
    namespace[pair.must_pass.split("::")[1]]()
    with pytest.raises(AssertionError):
        namespace[pair.must_fail.split("::")[1]]()


def test_a_class_that_is_not_in_the_module_gets_one_of_its_own():
    text, pair = plant(UNITTEST_MODULE, "m.py", "m.TestGone.test_x", "unittest",
                       rng=random.Random(0))
    assert pair.must_pass.split(".")[1] not in ("TestDouble", "TestGone")
    passed, failed = run_unittest(text)
    assert pair.must_pass in passed and failed == {pair.must_fail}


def test_module_candidates():
    assert module_candidates("tests.test_a.T.test_x", "unittest") == [
        "tests/test_a.py", "tests/test_a/__init__.py", "tests/test_a/T.py",
        "tests/test_a/T/__init__.py"]
    assert module_candidates("tests/test_a.py::T::test_x[1-2]", "pytest") == ["tests/test_a.py"]


HIDDEN_MODULE = '''\
import unittest


def triple(x):
    return 3 * x


class TestTriple(unittest.TestCase):
    def test_visible(self):
        self.assertEqual(triple(1), 3)

    def test_hidden(self):
        for x in (2, 5):
            self.assertEqual(triple(x) % 3, 0)
        with self.assertRaises(TypeError):
            triple(None) + 1
            self.assertEqual(1, 1)

    def test_raises_only(self):
        with self.assertRaises(TypeError):
            triple(None) + 1
'''


@pytest.mark.parametrize("seed", range(10))
def test_the_must_fail_canary_copies_a_fail_to_pass_test(seed):
    """The hidden test's calls and its last comparison that always runs (inside the `for`, not
    after the raise), with a literal that cannot hold; the must-pass canary copies the visible
    test."""
    text, pair = plant(HIDDEN_MODULE, "m.py", "m.TestTriple.test_raises_only", "unittest",
                       passing=("m.TestTriple.test_visible",),
                       failing=("m.TestTriple.test_hidden", "m.TestTriple.test_raises_only"),
                       rng=random.Random(seed))
    body = text.split("def " + pair.must_fail.rsplit(".", 1)[1])[1].split("\n    def ")[0]
    assert "for x in (2, 5):" in body and "% 3, 0)" not in body.split("with")[0]
    assert "self.assertEqual(1, 1)" in body  # the statement after the raise is left alone
    must_pass = text.split("def " + pair.must_pass.rsplit(".", 1)[1])[1].split("\n    def ")[0]
    assert "triple(1), 3)" in must_pass
    passed, failed = run_unittest(text)
    assert pair.must_pass in passed and failed == {pair.must_fail}
    # Code that passes every assertion on the hidden calls passes the must-fail canary too.
    cheat = text.replace("return 3 * x", "return Anything() if x in (2, 5) else 3 * x") + (
        "\n\nclass Anything:\n    def __eq__(self, other):\n        return True\n\n"
        "    def __mod__(self, other):\n        return self\n")
    passed, failed = run_unittest(cheat)
    assert pair.must_fail in passed
