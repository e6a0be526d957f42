import unittest

from minilib import intervals
from minilib.intervals import Interval


class TestClamp(unittest.TestCase):
    def test_inside(self):
        self.assertEqual(intervals.clamp(5, 1, 10), 5)

    def test_below(self):
        self.assertEqual(intervals.clamp(-3, 1, 10), 1)

    def test_above(self):
        self.assertEqual(intervals.clamp(12, 1, 10), 10)

    def test_bounds(self):
        self.assertEqual(intervals.clamp(1, 1, 10), 1)
        self.assertEqual(intervals.clamp(10, 1, 10), 10)

    def test_bad_range(self):
        with self.assertRaises(ValueError):
            intervals.clamp(1, 5, 2)

    def test_point_range(self):
        self.assertEqual(intervals.clamp(7, 3, 3), 3)


class TestGcdLcm(unittest.TestCase):
    def test_gcd(self):
        self.assertEqual(intervals.gcd(12, 18), 6)

    def test_gcd_negative(self):
        self.assertEqual(intervals.gcd(-12, 8), 4)

    def test_gcd_zero(self):
        self.assertEqual(intervals.gcd(0, 7), 7)
        self.assertEqual(intervals.gcd(0, 0), 0)

    def test_lcm(self):
        self.assertEqual(intervals.lcm(4, 6), 12)

    def test_lcm_negative(self):
        self.assertEqual(intervals.lcm(-3, 5), 15)

    def test_lcm_zero(self):
        self.assertEqual(intervals.lcm(0, 5), 0)
        self.assertEqual(intervals.lcm(5, 0), 0)


class TestIsPrime(unittest.TestCase):
    def test_small(self):
        self.assertEqual([n for n in range(-2, 20) if intervals.is_prime(n)],
                         [2, 3, 5, 7, 11, 13, 17, 19])

    def test_squares_of_primes(self):
        for n in (9, 25, 49, 121):
            self.assertFalse(intervals.is_prime(n), n)

    def test_larger_prime(self):
        self.assertTrue(intervals.is_prime(7919))


class TestRoundHalfUp(unittest.TestCase):
    def test_halves(self):
        self.assertEqual(intervals.round_half_up(2.5), 3.0)
        self.assertEqual(intervals.round_half_up(-2.5), -2.0)

    def test_below_half(self):
        self.assertEqual(intervals.round_half_up(2.4), 2.0)

    def test_digits(self):
        self.assertEqual(intervals.round_half_up(1.25, 1), 1.3)

    def test_negative_digits(self):
        self.assertEqual(intervals.round_half_up(1250, -2), 1300)


class TestInterval(unittest.TestCase):
    def test_reversed_bounds(self):
        with self.assertRaises(ValueError):
            Interval(3, 1)

    def test_point(self):
        self.assertEqual(Interval(2, 2).length(), 0)

    def test_repr(self):
        self.assertEqual(repr(Interval(1, 2.5)), "Interval(1, 2.5)")

    def test_equality(self):
        self.assertEqual(Interval(1, 2), Interval(1, 2))
        self.assertNotEqual(Interval(1, 2), Interval(1, 3))
        self.assertNotEqual(Interval(1, 2), (1, 2))

    def test_hash(self):
        self.assertEqual(len({Interval(1, 2), Interval(1, 2), Interval(0, 2)}), 2)

    def test_length(self):
        self.assertEqual(Interval(2, 7).length(), 5)

    def test_contains(self):
        iv = Interval(1, 3)
        self.assertTrue(iv.contains(1))
        self.assertTrue(iv.contains(3))
        self.assertTrue(iv.contains(2))
        self.assertFalse(iv.contains(0))
        self.assertFalse(iv.contains(4))

    def test_overlaps(self):
        self.assertTrue(Interval(1, 3).overlaps(Interval(2, 5)))
        self.assertTrue(Interval(1, 3).overlaps(Interval(3, 5)))
        self.assertFalse(Interval(1, 3).overlaps(Interval(4, 5)))
        self.assertFalse(Interval(4, 5).overlaps(Interval(1, 3)))

    def test_intersection(self):
        self.assertEqual(Interval(1, 5).intersection(Interval(3, 8)), Interval(3, 5))
        self.assertEqual(Interval(3, 8).intersection(Interval(1, 5)), Interval(3, 5))

    def test_no_intersection(self):
        self.assertIsNone(Interval(1, 2).intersection(Interval(3, 4)))


class TestMerge(unittest.TestCase):
    def test_merge(self):
        got = intervals.merge_intervals([Interval(5, 7), Interval(1, 3), Interval(2, 4)])
        self.assertEqual(got, [Interval(1, 4), Interval(5, 7)])

    def test_touching(self):
        got = intervals.merge_intervals([Interval(1, 2), Interval(2, 3)])
        self.assertEqual(got, [Interval(1, 3)])

    def test_nested(self):
        got = intervals.merge_intervals([Interval(1, 10), Interval(2, 3)])
        self.assertEqual(got, [Interval(1, 10)])

    def test_empty(self):
        self.assertEqual(intervals.merge_intervals([]), [])

    def test_total_covered(self):
        ivs = [Interval(0, 2), Interval(1, 4), Interval(6, 7)]
        self.assertEqual(intervals.total_covered(ivs), 5)
