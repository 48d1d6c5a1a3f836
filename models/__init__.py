"""DeepSeek-V4 model definitions, checkpoint loading and the tiny random checkpoint of the tests."""

from models.batch import DecodeBatch, ForwardBatch, SequenceChunk
from models.cache import ModelCache
from models.config import ConfigError, ModelConfig
from models.loader import CheckpointError, load_model
from models.model import DeepseekV4
from models.parallel import SINGLE, TensorParallel

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeepseekV4",
    "DecodeBatch",
    "ForwardBatch",
    "ModelCache",
    "ModelConfig",
    "SINGLE",
    "SequenceChunk",
    "TensorParallel",
    "load_model",
]
