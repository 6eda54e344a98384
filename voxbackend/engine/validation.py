"""Checking a submitted request on the caller's thread, before any device work: its prompt ids, its feature rows
and its max_tokens (against the server's cap, the model's context and the KV pool). Errors are InvalidRequest."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from voxbackend.config import EngineConfig
from voxbackend.engine.kv_pool import KVPool
from voxbackend.errors import InvalidRequest
from voxbackend.models.base import FEATURE, Prompt, SpeechModel, as_prompt
from voxbackend.request import GuideRow
from voxbackend.sampling_params import SamplingParams


@dataclass
class CheckedRequest:
    prompt_ids: list[int] | list[list[int]]  # ids [L], or rows [L, token_columns] (-1 = no entry)
    sampling: SamplingParams  # validated, max_tokens clamped to the context
    track: Any  # the model's input state split off the prompt (split_prompt)
    conditioning: dict
    feature_positions: list[int]
    features: torch.Tensor | None  # [N, hidden] on the device, one per feature position
    guide: GuideRow | None = None  # the unconditioned row, for sampling.cfg_weight > 0


def feature_mask(prompt: np.ndarray) -> np.ndarray:
    """Which positions of a prompt (ids [L] or rows [L, columns]) are FEATURE rows."""
    return (prompt if prompt.ndim == 1 else prompt[:, 0]) == FEATURE


class RequestValidator:
    def __init__(self, model: SpeechModel, config: EngineConfig, pool: KVPool):
        self.model = model
        self.config = config
        self.pool = pool
        spec = model.spec
        if model.engine_features and spec.guidance:  # the guide row would need its own vectors from the engine
            raise ValueError(f"{spec.name}: engine_features does not go with guidance")
        self.max_tokens_limit = config.max_tokens_limit or spec.max_tokens or spec.geometry.max_context

    def check(self, prompt: list[int] | list[list[int]] | Prompt, sampling: SamplingParams | None,
              text_open: bool) -> CheckedRequest:
        """The request's parts, checked (InvalidRequest otherwise) and converted for the engine."""
        if text_open and not self.model.text_streaming:
            raise InvalidRequest(f"{self.model.spec.name} does not take text in pieces (text_open)", field="text")
        prepared = as_prompt(prompt)
        params = prepared.limit((sampling or self.model.default_sampling()).validated())
        conditioning = self.model.check_conditioning(prepared.conditioning)
        ids, track = self._check_prompt(prepared.ids, text_open)
        feature_positions, features = self._check_features(ids, conditioning)
        if params.max_tokens > self.max_tokens_limit:  # refused, not clamped: the client asked for more
            raise InvalidRequest(
                f"max_tokens is {params.max_tokens}; this server allows at most {self.max_tokens_limit} for "
                f"{self.model.spec.name}", field="max_tokens"
            )
        max_context = self.model.spec.geometry.max_context
        if len(ids) + params.max_tokens > max_context:
            params.max_tokens = max_context - len(ids)  # generation ends at the context ("length")
        guide = self._guide(ids, params, conditioning, feature_positions, features)
        rows = 1 if guide is None else 2
        needed = self.pool.pages_for(len(ids) + params.max_tokens) * rows
        if needed > self.pool.num_pages:  # it could never run, even alone in the pool
            raise InvalidRequest(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens})" + (" on two rows (guidance)"
                if guide else "") + f" needs {needed} KV pages; the pool has {self.pool.num_pages}", field="max_tokens"
            )
        return CheckedRequest(ids, params, track, conditioning, feature_positions, features, guide)

    def _guide(self, ids: list, params: SamplingParams, conditioning: dict, feature_positions: list[int],
               cond_features: torch.Tensor | None) -> GuideRow | None:
        """The unconditioned row of a request with cfg_weight > 0 (refused for a model without guidance)."""
        if params.cfg_weight == 0:
            return None
        if not self.model.spec.guidance:
            raise InvalidRequest(f"cfg_weight: {self.model.spec.name} has no classifier-free guidance (send 0)",
                                 field="cfg_weight")
        prompt = self.model.unconditioned_prompt(ids)
        mask = feature_mask(np.asarray(ids))
        same_rows = len(prompt) == len(ids) and (feature_mask(np.asarray(prompt)) == mask).all()
        if not same_rows:
            raise ValueError(f"{self.model.spec.name}: the unconditioned prompt must have the prompt's positions")
        features = self.model.unconditioned_features(conditioning)
        if features is None:  # the conditioned row's vectors, shared
            return GuideRow(prompt, cond_features)
        if len(features) != len(feature_positions):
            raise InvalidRequest(f"the unconditioned row has {len(features)} feature vectors for "
                                 f"{len(feature_positions)} feature rows", field="prompt_ids")
        vectors = torch.as_tensor(np.asarray(features, dtype=np.float32), device=self.config.device)
        return GuideRow(prompt, vectors.to(self.config.torch_dtype))

    def _check_prompt(self, prompt_ids, text_open: bool) -> tuple[list[int] | list[list[int]], object]:
        """Ids [L] for one-column models, rows [L, token_columns] (-1 = no entry) for multi-column ones; the
        model splits off its input track (split_prompt) before the positions are checked."""
        spec = self.model.spec
        columns = spec.token_columns
        try:
            prompt = np.asarray(prompt_ids, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            prompt = None
        want = "a list of integers" if columns == 1 else f"rows of {columns} integers"
        if prompt is None or prompt.ndim != (1 if columns == 1 else 2) or columns > 1 and prompt.shape[1] != columns:
            raise InvalidRequest(f"prompt_ids must be {want}")
        rows, track = self.model.split_prompt(prompt.tolist(), text_open)
        prompt = np.asarray(rows, dtype=np.int64).reshape((-1,) if columns == 1 else (-1, columns))
        if not len(prompt):
            raise InvalidRequest("prompt is empty")
        ids = prompt.copy()  # the ids to range-check: FEATURE rows have none in column 0
        if columns == 1:
            ids[feature_mask(prompt)] = 0
        else:
            ids[feature_mask(prompt), 0] = -1
        if columns == 1:
            vocab = spec.geometry.vocab_size
            if ids.min() < 0 or ids.max() >= vocab:
                raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
        else:
            vocab = np.asarray(spec.column_vocab or [spec.geometry.vocab_size] * columns)
            if (ids < -1).any() or (ids >= vocab[None, :]).any():
                raise InvalidRequest(f"prompt ids of column j must be -1 (absent) or in [0, {list(vocab)}[j])")
        if len(prompt) >= spec.geometry.max_context:
            raise InvalidRequest(
                f"prompt is {len(prompt)} positions; the model's context is {spec.geometry.max_context}"
            )
        return prompt.tolist(), track

    def _check_features(self, prompt: list, conditioning: dict) -> tuple[list[int], torch.Tensor | None]:
        """The FEATURE rows of a checked prompt and their vectors from the model, one per row, on the device."""
        positions = np.flatnonzero(feature_mask(np.asarray(prompt))).tolist()
        if self.model.engine_features:  # the engine computes them once the request is admitted (Engine.step)
            features, count = None, self.model.feature_count(conditioning)
        else:
            features = self.model.prompt_features(conditioning)
            count = 0 if features is None else len(features)
        if count != len(positions):
            raise InvalidRequest(f"the prompt has {len(positions)} feature rows; the request's conditioning gives "
                                 f"{count} feature vectors", field="prompt_ids")
        if features is None:
            return positions, None
        vectors = torch.as_tensor(np.asarray(features, dtype=np.float32), device=self.config.device)
        return positions, vectors.to(self.config.torch_dtype)
