"""Exception types. Every user-facing error is a :class:`PearlError`: the CLI prints its
message on one line and exits with status 2, without a traceback."""


class PearlError(Exception):
    """Base class of errors a user can act on."""


class ConfigError(PearlError):
    """A config file or value is malformed; the message names the field and the fix."""


class SpecError(PearlError):
    """A worker-configuration SPEC such as ``3P5D`` or ``8C`` cannot be parsed or is impossible."""


class TransitionError(PearlError):
    """An illegal move of a worker's lifecycle in the role table."""


class InvariantError(PearlError):
    """A role-table invariant would break (e.g. one GPU bound to two rollout workers)."""


class CalibrationError(PearlError):
    """A bandwidth measurement failed or its output is unusable (no data rows, wrong
    values reported by nccl-tests, a gloo rank that died); the message says which."""
