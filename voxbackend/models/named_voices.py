"""Voices by name, for the models that clone voices (CosyVoice2, Chatterbox): a bounded LRU of voices computed from
a clip sent with a name, and the checkpoint's stored voices (voices/<name>.safetensors). A name is an identity: a
clip sent with a name already known is not recomputed."""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Generic, Protocol, TypeVar

from voxbackend.errors import InvalidRequest

VOICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
VOICES_DIR = "voices"


class Savable(Protocol):
    def save(self, path: str | Path) -> None: ...


V = TypeVar("V", bound=Savable)


class NamedVoices(Generic[V]):
    def __init__(self, voices_dir: str | Path | None, load: Callable[[Path], V], max_cached: int):
        self.voices_dir = Path(voices_dir) if voices_dir is not None else None
        self.load = load  # a stored file -> its voice
        self.max_cached = max_cached
        self._cache: OrderedDict[str, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str, compute: Callable[[], V] | None) -> V:
        """The voice called `name`: cached, else `compute()` (a clip sent with it), else stored."""
        check_name(name)
        with self._lock:
            if name in self._cache:
                self._cache.move_to_end(name)
                return self._cache[name]
        if compute is not None:
            voice = compute()
        else:
            path = self._stored(name)
            if path is None:
                raise InvalidRequest(f"voice {name!r} is not known: send a reference clip with it once, or store "
                                     f"it as {VOICES_DIR}/{name}.safetensors in the checkpoint", field="voice")
            voice = self.load(path)
        with self._lock:
            self._cache[name] = voice
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return voice

    def save(self, name: str, voice: V) -> Path:
        """Stores a voice in voices/<name>.safetensors so later servers know it without a clip."""
        check_name(name)
        if self.voices_dir is None:
            raise ValueError("no voices folder to store the voice in")
        self.voices_dir.mkdir(parents=True, exist_ok=True)
        path = self.voices_dir / f"{name}.safetensors"
        voice.save(path)
        return path

    def stored(self) -> list[str]:
        if self.voices_dir is None or not self.voices_dir.is_dir():
            return []
        return sorted(p.stem for p in self.voices_dir.glob("*.safetensors"))

    def _stored(self, name: str) -> Path | None:
        path = self.voices_dir / f"{name}.safetensors" if self.voices_dir is not None else None
        return path if path is not None and path.is_file() else None


def check_name(name) -> None:
    if not isinstance(name, str) or not VOICE_NAME.fullmatch(name):
        raise InvalidRequest(f"voice name must match {VOICE_NAME.pattern} (letters, digits, _ . -), got {name!r}",
                             field="voice")
