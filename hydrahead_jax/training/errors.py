"""Errors that are the user's to fix: train.py prints their message (no traceback) and exits with status 2."""

from hydrahead_jax.config import ConfigError
from hydrahead_jax.data.corpus import CorpusError
from hydrahead_jax.data.protocol import TokenizerModelMismatchError
from hydrahead_jax.hybrid.head_map import HeadMapError
from hydrahead_jax.selection import SelectionError
from hydrahead_jax.training.checkpoint import (
    CheckpointMismatchError,
    CheckpointReadError,
    ConfigMismatchError,
    WorkdirError,
)
from hydrahead_jax.training.metrics import NonFiniteLossError
from hydrahead_jax.training.sharding import ShardingError


class StageOrderError(RuntimeError):
    """A stage was asked for before the stage it starts from has finished."""


USER_ERRORS = (
    CheckpointMismatchError,
    CheckpointReadError,
    ConfigError,
    CorpusError,
    HeadMapError,
    ConfigMismatchError,
    NonFiniteLossError,
    ShardingError,
    SelectionError,
    StageOrderError,
    TokenizerModelMismatchError,
    WorkdirError,
)
