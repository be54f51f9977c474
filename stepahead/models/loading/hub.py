"""Hugging Face model ids: `stepahead serve ORG/NAME` and `LLM("ORG/NAME")` resolve as in vLLM.

A local path wins; otherwise an id of the form ORG/NAME is looked up in the Hugging Face cache (HF_HOME,
or --download-dir) and downloaded when online. HF_HUB_OFFLINE=1 allows only the cache; HF_TOKEN is
used for gated and private models (huggingface_hub reads both).
"""

from __future__ import annotations

import os
import re

# What the engine reads from a model repository: config, weights, tokenizer, generation defaults.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt", "*.model"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and ".." not in model


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve_repo(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    """The local folder of the model's snapshot; a ValueError in one line when there is none."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = _offline()
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                 allow_patterns=ALLOW_PATTERNS, local_files_only=offline)
    except LocalEntryNotFoundError as e:
        where = f"in {download_dir}" if download_dir else "in the Hugging Face cache (HF_HOME)"
        how = ("HF_HUB_OFFLINE is set: download it first (huggingface-cli download "
               f"{repo_id}) or unset HF_HUB_OFFLINE" if offline else f"and it could not be downloaded: {e}")
        raise ValueError(f"model {repo_id!r} is not a local path and not {where}; {how}") from None
    except GatedRepoError:
        raise ValueError(f"model {repo_id!r} is gated on the Hugging Face hub: accept its terms and set HF_TOKEN") \
            from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {repo_id!r} is neither a local path nor a model on the Hugging Face hub "
                         "(private models need HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ValueError(f"model {repo_id!r} has no revision {revision!r}") from None
    except (HfHubHTTPError, OSError) as e:
        raise ValueError(f"model {repo_id!r}: downloading from the Hugging Face hub failed: {e}") from None
