"""The Rust side of the package (see kestrel/__init__.py): the trainer's own code, GIL released."""

from typing import List, Optional, Tuple

__version__: str

class KestrelError(Exception):
    """A Kestrel command or operation failed; the message is the CLI's."""

class DataError(KestrelError):
    """A bad input: a table, column, image, label, cache or weights file."""

class ConfigError(KestrelError):
    """Wrong or missing configuration (a flag, URL, setting; a backbone or engine not installed)."""

class ServiceError(KestrelError):
    """A service did not answer (broker, MLflow, a peer rank) or a wait ran out of time."""

class GateError(KestrelError):
    """A check refused the result: an export gate, a rollout that did not complete."""

class PeerFailed(KestrelError):
    """Another rank of the job failed first; its error is the job's."""

def init_logging(verbosity: int) -> None:
    """The Rust log records as `logging` records at `verbosity`; takes effect when called."""

def pretrained_path(name: str) -> Optional[str]:
    """Where this process keeps the pretrained backbone `name`'s weights, or None."""

def flag_specs(command: str) -> List[Tuple[str, str, str]]:
    """The visible flags of ``trainer COMMAND``: (keyword, Python type, help)."""

def run(argv: List[str]) -> str:
    """Runs the `trainer` command line `argv` (no program name) here; returns what it printed."""

def run_rank(
    argv: List[str], rank: int, world: int, lead: str, token: str, timeout_s: float = 600.0
) -> str:
    """Runs a distributed command as rank `rank` (> 0) of `world`; rank 0 listens at `lead`."""


class Lead:
    """Rank 0 of a job of processes, listening on `host` at `port`."""

    port: int
    def __init__(self, host: str) -> None: ...
    def run(self, argv: List[str], world: int, token: str, timeout_s: float = 600.0) -> str: ...

class Extractor:
    """A backbone's frozen network from `trainer prepare`'s flags (`--backbone`, `--engine`...)."""

    def __init__(self, flags: List[str]) -> None: ...
    def extract(
        self, names: List[str], images: List[bytes]
    ) -> Tuple[bytes, int, List[Optional[str]]]:
        """(little-endian f32 rows of the images that decoded, dims, per-image error or None)."""
    def store(self, cache: str, content: List[str], features: bytes, seconds: float) -> str:
        """Stores rows (as `extract` returns them) of the images whose bytes have the sha256s
        `content` as a feature cache under `cache`; returns the directory written."""

class Predictor:
    """An exported artifact, loaded and health-checked as the edge agent loads it."""

    labels: List[str]
    def __init__(self, artifact: str, threads: int = 1, max_bytes: int = 67108864) -> None: ...
    def predict(
        self, names: List[str], images: List[bytes], k: int
    ) -> List[Tuple[Optional[List[Tuple[str, int, float]]], Optional[str]]]: ...
