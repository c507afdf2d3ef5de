"""The one error family of ringpass.

Every error the project raises on purpose is a `RingpassError`. `lowering` owns the family (it is the
package with no dependencies on the other); `ringpass` re-exports it. Each message says what was found,
where, and what to do about it.
"""


class RingpassError(Exception):
    """Base class of every error ringpass raises on purpose."""


class InvalidInputError(RingpassError, ValueError):
    """The caller passed something the ring cannot work with (shapes, dtypes, devices, layouts)."""


class NotSupportedError(RingpassError, NotImplementedError):
    """A well-formed request for a feature that is not built (yet); never answered with a guess."""


class RingpassWarning(UserWarning):
    """Something ran, but not as a user of the ring expects (a graph that runs unsharded)."""
