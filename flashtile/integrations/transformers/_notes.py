"""The integration's name and its log lines (each message once per process)."""

from __future__ import annotations

import functools
import logging

import torch

NAME = "flashtile"
logger = logging.getLogger("flashtile")


@functools.lru_cache(maxsize=None)
def _note_once(message: str):
    logger.warning("flashtile (transformers): %s", message)


def _note(message: str):
    if not torch.compiler.is_compiling():  # a logging call would break the graph
        _note_once(message)
