import unittest

from minilib import stats


class TestAverages(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(stats.mean([1, 2, 3, 6]), 3)

    def test_mean_generator(self):
        self.assertEqual(stats.mean(x for x in (2, 4)), 3)

    def test_mean_empty(self):
        with self.assertRaises(ValueError):
            stats.mean([])

    def test_median_odd(self):
        self.assertEqual(stats.median([5, 1, 3]), 3)

    def test_median_even(self):
        self.assertEqual(stats.median([4, 1, 3, 2]), 2.5)

    def test_median_single(self):
        self.assertEqual(stats.median([7]), 7)

    def test_median_empty(self):
        with self.assertRaises(ValueError):
            stats.median([])

    def test_mode(self):
        self.assertEqual(stats.mode([1, 2, 2, 3]), 2)

    def test_mode_tie_first_seen(self):
        self.assertEqual(stats.mode(["b", "a", "a", "b"]), "b")

    def test_mode_empty(self):
        with self.assertRaises(ValueError):
            stats.mode([])


class TestSpread(unittest.TestCase):
    def test_population_variance(self):
        self.assertEqual(stats.variance([2, 4, 4, 4, 5, 5, 7, 9]), 4)

    def test_sample_variance(self):
        self.assertEqual(stats.variance([1, 2, 3, 4], sample=True), 5 / 3)

    def test_variance_single(self):
        self.assertEqual(stats.variance([3]), 0)

    def test_variance_too_few(self):
        with self.assertRaises(ValueError):
            stats.variance([], sample=False)
        with self.assertRaises(ValueError):
            stats.variance([1], sample=True)

    def test_percentile_ends(self):
        self.assertEqual(stats.percentile([3, 1, 2], 0), 1)
        self.assertEqual(stats.percentile([3, 1, 2], 100), 3)

    def test_percentile_interpolates(self):
        self.assertEqual(stats.percentile([10, 20, 30, 40], 50), 25)
        self.assertEqual(stats.percentile([10, 20, 30, 40, 50], 25), 20)
        self.assertEqual(stats.percentile([0, 10], 30), 3)

    def test_percentile_bad_q(self):
        for q in (-1, 101):
            with self.assertRaises(ValueError):
                stats.percentile([1], q)

    def test_percentile_empty(self):
        with self.assertRaises(ValueError):
            stats.percentile([], 50)


class TestListHelpers(unittest.TestCase):
    def test_chunks(self):
        self.assertEqual(stats.chunks(range(7), 3), [[0, 1, 2], [3, 4, 5], [6]])

    def test_chunks_exact(self):
        self.assertEqual(stats.chunks("abcd", 2), [["a", "b"], ["c", "d"]])

    def test_chunks_bad_size(self):
        with self.assertRaises(ValueError):
            stats.chunks([1], 0)

    def test_windows(self):
        self.assertEqual(stats.windows([1, 2, 3, 4], 2), [[1, 2], [2, 3], [3, 4]])

    def test_windows_step(self):
        self.assertEqual(stats.windows(range(7), 3, step=2), [[0, 1, 2], [2, 3, 4], [4, 5, 6]])

    def test_windows_too_short(self):
        self.assertEqual(stats.windows([1, 2], 3), [])

    def test_windows_bad(self):
        with self.assertRaises(ValueError):
            stats.windows([1, 2], 0)
        with self.assertRaises(ValueError):
            stats.windows([1, 2], 1, step=0)

    def test_flatten(self):
        self.assertEqual(stats.flatten([1, [2, (3, [4])], [], 5]), [1, 2, 3, 4, 5])

    def test_flatten_keeps_strings(self):
        self.assertEqual(stats.flatten(["ab", ["cd"]]), ["ab", "cd"])

    def test_top_k(self):
        counts = {"a": 3, "b": 5, "c": 3, "d": 1}
        self.assertEqual(stats.top_k(counts, 3), [("b", 5), ("a", 3), ("c", 3)])

    def test_top_k_zero(self):
        self.assertEqual(stats.top_k({"a": 1}, 0), [])

    def test_top_k_negative(self):
        with self.assertRaises(ValueError):
            stats.top_k({"a": 1}, -1)

    def test_group_by(self):
        got = stats.group_by(["apple", "bob", "avocado", "cat", "banana"], lambda w: w[0])
        self.assertEqual(got, {"a": ["apple", "avocado"], "b": ["bob", "banana"], "c": ["cat"]})
        self.assertEqual(list(got), ["a", "b", "c"])
