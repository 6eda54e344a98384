"""Engines of the served models on their tiny checkpoints, driven on the test's own thread (engine.step(), no engine
thread): requests arrive one every few steps, so tests can check that a request's tokens and audio do not depend on
what else is in the batch."""
from __future__ import annotations

import numpy as np

import voxbackend
from voxbackend.models.registry import KINDS
from voxbackend.triton.loading import import_object

SERVED = [name for name, kind in KINDS.items() if kind.served]  # the models the Triton repository serves


def tiny_engine(name: str, **options):
    """An engine of the served model `name` on its cached tiny default checkpoint, with engine `options`."""
    model_dir, codec_dir = import_object(KINDS[name].tiny_checkpoint)()
    return voxbackend.load(model_dir, codec_dir, model=name, **options)


def run_staggered(engine, prompts, sampling, every: int = 3, texts: list | None = None) -> list[list[int]]:
    """Submit a new request every `every` engine steps; each request's token ids. `texts`: filled with each
    request's TEXT event pieces (a model with text out)."""
    from voxbackend.events import EventKind

    done: dict[str, list[int]] = {}
    pieces: dict[str, list[str]] = {}

    def on_event(e):
        if e.kind is EventKind.TEXT:
            pieces.setdefault(e.request_id, []).append(e.text)
        elif e.final:
            done[e.request_id] = e.token_ids

    ids, step = [], 0
    while len(done) < len(prompts):
        if step % every == 0 and len(ids) < len(prompts):
            ids.append(engine.submit(prompts[len(ids)], sampling, on_event, streaming=False))
        engine.step()
        step += 1
    if texts is not None:
        texts.extend(pieces.get(i, []) for i in ids)
    return [done[i] for i in ids]


def stream_audio(engine, requests: list[tuple], every: int) -> list[np.ndarray]:
    """(prompt, sampling) requests submitted one every `every` engine steps; each one's audio."""
    chunks: dict[str, list[np.ndarray]] = {}
    done: set[str] = set()

    def on_event(e):
        if e.audio is not None and len(e.audio):
            chunks.setdefault(e.request_id, []).append(e.audio)
        if e.final:
            done.add(e.request_id)

    ids, step = [], 0
    while len(done) < len(requests):
        if step % every == 0 and len(ids) < len(requests):
            ids.append(engine.submit(*requests[len(ids)], on_event))
        engine.step()
        step += 1
    return [np.concatenate(chunks[rid]) for rid in ids]
