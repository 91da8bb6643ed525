"""Boolean environment variables, all read by one rule (docs/environment.md).

``0``, ``false``, ``no``, ``off`` and the empty string are off; ``1``, ``true``, ``yes``
and ``on`` are on; case and surrounding spaces do not matter. Anything else is refused
with an error naming the variable: on hundreds of ranks a typo such as
``MPICOMP_DEBUG=ture`` is better stopped at start than guessed at.
"""

from __future__ import annotations

import os

__all__ = ["OFF", "ON", "env_flag"]

#: The words that switch a boolean variable on, and off (compared lowercased, stripped).
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off", "")


def env_flag(name: str, unset: bool | None = False, environ=os.environ) -> bool | None:
    """Return the boolean variable ``name``: True or False by the rule, ``unset`` when unset.

    Raises:
        ValueError: the value is none of the words of ``ON`` or ``OFF``.
    """
    raw = environ.get(name)
    if raw is None:
        return unset
    word = raw.strip().lower()
    if word in ON:
        return True
    if word in OFF:
        return False
    raise ValueError(
        f"{name}={raw!r} is not a boolean: use 1, true, yes or on to switch it on, "
        "0, false, no, off or empty to switch it off (any case)"
    )
