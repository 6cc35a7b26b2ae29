"""Kiln's Python SDK and command line. Imports neither torch nor the server.

from kiln import Client
"""

from kiln.client import Client, Page
from kiln.errors import (
    APIConnectionError,
    APIStatusError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    KilnError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitError,
)
from kiln.spec import Hyperparameters, JobRequest, LoraSpec, MemorySpec, ParallelSpec

__version__ = "0.1.0"
__all__ = [
    "Client",
    "Page",
    "Hyperparameters",
    "JobRequest",
    "LoraSpec",
    "MemorySpec",
    "ParallelSpec",
    "KilnError",
    "APIConnectionError",
    "APIStatusError",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "InternalServerError",
    "NotFoundError",
    "PayloadTooLargeError",
    "RateLimitError",
]
