"""User-facing errors: each names the problem and what to do about it."""


class GnnrayError(Exception):
    """Base class for errors caused by the user's input rather than a bug."""


class ConfigError(GnnrayError, ValueError):
    """A command-line option or configuration value is invalid."""


class DatasetError(GnnrayError, ValueError):
    """A dataset is missing, unreadable or inconsistent."""


class ClusterError(GnnrayError, RuntimeError):
    """The Ray cluster cannot provide what the job asks for."""


class CheckpointError(GnnrayError, RuntimeError):
    """A run's checkpoints cannot be resumed from (corrupt, and no older good one)."""
