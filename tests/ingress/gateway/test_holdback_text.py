"""The hold-back window over a long output: its text, held count and releases are exact over
thousands of deltas, and adding a delta copies none of the text already held (a `text +=` per
delta copied it all each time: quadratic in the output's length)."""

from router.ingress.gateway.guard_text import HoldBack
from router.ingress.request import Delta

WINDOW = 8


class Text(str):
    """A delta's text that counts the characters concatenated in front of it (str + Text calls
    Text.__radd__): what adding it to an accumulated string copies."""

    copied = 0

    def __radd__(self, other: str) -> str:
        Text.copied += len(other)
        return str(other) + str(self)


def test_the_held_text_over_many_deltas_is_exact_and_adding_copies_nothing_held():
    # 5,000 deltas of 1-3 characters, some with a combining accent (it joins the unit before it)
    pieces = [("ab", "c", "e\u0301f")[i % 3] for i in range(5000)]
    hold, released = HoldBack(WINDOW), []
    Text.copied = 0
    for i, piece in enumerate(pieces):
        hold.add(Delta("r", Text(piece), [i], None))
        released += [d.text for d in hold.release(False)]
    assert Text.copied == 0
    # 1,666 cycles of "ab", "c", "e\u0301f" (6 raw characters, 5 units: the accent joins its e), then "ab", "c"
    assert (hold.text, hold.length) == ("".join(pieces), 1666 * 6 + 3)
    # 1666 * 5 + 3 units, the last ("c") still open: 8,332 committed. A delta is released once 8
    # follow its end (in units): the last such end is cycle 1664's "c" (unit 8,323 <= 8,324), raw 9,987
    assert hold.released == 1664 * 6 + 3 == 9987 and hold.held == 12
    assert "".join(released) == hold.text[:9987]
    hold.add(Delta("r", "", [], "length"), final=True)
    assert "".join(released + [d.text for d in hold.release(True)]) == hold.text
    assert hold.held == 0
