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


class FeatureShardError(GnnrayError, RuntimeError):
    """A feature shard's node did not answer in time or was lost (the attempt fails; restarts rebuild it)."""


def size_text(n: float) -> str:
    """``n`` bytes as errors say it: GiB from 1 GiB up, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def last_line(e: BaseException) -> str:
    """The last non-empty line of ``e``'s text (Ray's errors end with the cause), or its type's name."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__
