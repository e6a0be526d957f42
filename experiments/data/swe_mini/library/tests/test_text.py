import unittest

from minilib import text


class TestSlugify(unittest.TestCase):
    def test_basic(self):
        self.assertEqual(text.slugify("Hello, World!"), "hello-world")

    def test_separator(self):
        self.assertEqual(text.slugify("A  b c", sep="_"), "a_b_c")

    def test_digits_kept(self):
        self.assertEqual(text.slugify("Route 66 -- West"), "route-66-west")

    def test_only_punctuation(self):
        self.assertEqual(text.slugify("!!!"), "")


class TestCamelToSnake(unittest.TestCase):
    def test_simple(self):
        self.assertEqual(text.camel_to_snake("fooBar"), "foo_bar")

    def test_acronym(self):
        self.assertEqual(text.camel_to_snake("parseHTTPResponse"), "parse_http_response")

    def test_leading_capital(self):
        self.assertEqual(text.camel_to_snake("FooBar"), "foo_bar")

    def test_trailing_acronym(self):
        self.assertEqual(text.camel_to_snake("getID"), "get_id")

    def test_lower_unchanged(self):
        self.assertEqual(text.camel_to_snake("plain"), "plain")


class TestSnakeToCamel(unittest.TestCase):
    def test_lower_first(self):
        self.assertEqual(text.snake_to_camel("parse_http_response"), "parseHttpResponse")

    def test_upper_first(self):
        self.assertEqual(text.snake_to_camel("foo_bar", upper_first=True), "FooBar")

    def test_extra_underscores(self):
        self.assertEqual(text.snake_to_camel("__foo__bar_"), "fooBar")

    def test_empty(self):
        self.assertEqual(text.snake_to_camel("___"), "")

    def test_single_word_lowered(self):
        self.assertEqual(text.snake_to_camel("Foo"), "foo")


class TestTruncate(unittest.TestCase):
    def test_short_text_unchanged(self):
        self.assertEqual(text.truncate("abc", 3), "abc")

    def test_cut(self):
        self.assertEqual(text.truncate("abcdefgh", 6), "abc...")

    def test_width_within_suffix(self):
        self.assertEqual(text.truncate("abcdefgh", 2), "..")

    def test_width_equals_suffix(self):
        self.assertEqual(text.truncate("abcdefgh", 3), "...")

    def test_custom_suffix(self):
        self.assertEqual(text.truncate("abcdefgh", 5, suffix="~"), "abcd~")

    def test_negative_width(self):
        with self.assertRaises(ValueError):
            text.truncate("abc", -1)

    def test_zero_width(self):
        self.assertEqual(text.truncate("abc", 0), "")


class TestWrap(unittest.TestCase):
    def test_width(self):
        self.assertEqual(text.wrap("the quick brown fox", 10), ["the quick", "brown fox"])

    def test_exact_fit(self):
        self.assertEqual(text.wrap("ab cd", 5), ["ab cd"])

    def test_long_word(self):
        self.assertEqual(text.wrap("a abcdefgh b", 4), ["a", "abcdefgh", "b"])

    def test_empty(self):
        self.assertEqual(text.wrap("   ", 4), [])

    def test_bad_width(self):
        with self.assertRaises(ValueError):
            text.wrap("a", 0)

    def test_width_one(self):
        self.assertEqual(text.wrap("a b", 1), ["a", "b"])


class TestCenter(unittest.TestCase):
    def test_even(self):
        self.assertEqual(text.center("ab", 6), "  ab  ")

    def test_odd_extra_right(self):
        self.assertEqual(text.center("ab", 5, "*"), "*ab**")

    def test_too_wide(self):
        self.assertEqual(text.center("abcdef", 4), "abcdef")

    def test_bad_fill(self):
        with self.assertRaises(ValueError):
            text.center("a", 4, "--")


class TestCountWords(unittest.TestCase):
    def test_counts(self):
        self.assertEqual(text.count_words("the cat and the hat"),
                         {"the": 2, "cat": 1, "and": 1, "hat": 1})

    def test_order_of_first_appearance(self):
        self.assertEqual(list(text.count_words("b a b c a")), ["b", "a", "c"])

    def test_case_and_quotes(self):
        self.assertEqual(text.count_words("Don't 'quote' DON'T"), {"don't": 2, "quote": 1})

    def test_empty(self):
        self.assertEqual(text.count_words("123 !!"), {})


class TestIsPalindrome(unittest.TestCase):
    def test_phrase(self):
        self.assertTrue(text.is_palindrome("A man, a plan, a canal: Panama"))

    def test_not(self):
        self.assertFalse(text.is_palindrome("abca"))

    def test_near_miss_middle(self):
        self.assertFalse(text.is_palindrome("abcdba"))

    def test_empty(self):
        self.assertTrue(text.is_palindrome(""))

    def test_even(self):
        self.assertTrue(text.is_palindrome("abba"))
