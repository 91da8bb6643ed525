"""What the signSGD family's twins share: the tie rules and the summation order of |x|."""

# What a tie of votes decides.
TIE_NEGATIVE = 0
TIE_POSITIVE = 1
TIE_RANDOM = 2

#: Elements per partial sum of |x| (added in a fixed order, then chunk by chunk): the
#: scale's bits depend on it. A multiple of 8, so a chunk owns whole bytes of sign bits.
CHUNK = 1 << 16
