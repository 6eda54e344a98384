"""Naive Orpheus baseline: how the official implementation serves, one request at a time.

transformers `generate` produces tokens; a streamer turns each token into a SNAC code and, every 7 codes once
28 are in hand, decodes the last 28 (4 frames) with `snac.SNAC` and keeps samples 2048:4096, exactly like
orpheus_tts/decoder.py. Decoding runs inline between LM steps (in the official code it blocks vLLM's event
loop the same way), which also keeps the global torch RNG use in one thread, so `seed` makes a run repeatable.

    python perf/naive_orpheus.py MODEL_DIR CODEC_DIR "Hello world." out.wav
"""
from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

START_HUMAN, END_HUMAN, START_AI, START_SPEECH = 128259, 128260, 128261, 128257
EOT_ID, STOP_ID = 128009, 128258
AUDIO_BASE, CODEBOOK = 128266, 4096
SAMPLE_RATE = 24000


def orpheus_prompt_ids(tokenizer, text: str, voice: str = "tara") -> list[int]:
    ids = tokenizer(f"{voice}: {text}").input_ids  # starts with BOS 128000
    return [START_HUMAN, *ids, EOT_ID, END_HUMAN, START_AI, START_SPEECH]


def frames_to_snac_codes(codes: list[int]) -> list[torch.Tensor]:
    """7 codes per frame -> the 3 SNAC layers: (c0), (c1, c4), (c2, c3, c5, c6)."""
    f = torch.tensor(codes, dtype=torch.long).view(-1, 7)
    l0 = f[:, 0]
    l1 = f[:, [1, 4]].reshape(-1)
    l2 = f[:, [2, 3, 5, 6]].reshape(-1)
    return [l0.unsqueeze(0), l1.unsqueeze(0), l2.unsqueeze(0)]


def _processors(prompt_len: int, temperature: float, top_p: float, repetition_penalty: float, constrain: bool):
    from transformers import (LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                              TemperatureLogitsWarper, TopPLogitsWarper)

    class AudioConstraint(LogitsProcessor):
        """Allow only codebook position p = (tokens generated so far) % 7, plus the stop token at a frame's start
        (the engine's candidates)."""

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            p = (input_ids.shape[1] - prompt_len) % 7
            lo = AUDIO_BASE + CODEBOOK * p
            mask = torch.full_like(scores, float("-inf"))
            mask[:, lo:lo + CODEBOOK] = 0.0
            if p == 0:
                mask[:, STOP_ID] = 0.0
            return scores + mask

    # vLLM's order (what the official server runs): logits processors, penalties, temperature, top-p.
    # We pass them all ourselves, since generate() would put a custom processor after top-p.
    procs = [AudioConstraint()] if constrain else []
    if repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    return LogitsProcessorList(procs)


class NaiveOrpheus:
    def __init__(self, model_dir: str | Path, codec_dir: str | Path, device: str = "cpu"):
        from snac import SNAC
        from transformers import AutoTokenizer, LlamaForCausalLM

        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(self.device).eval()
        self.snac = SNAC.from_pretrained(str(codec_dir)).to(self.device).eval()
        self.generated_tokens = 0  # LM tokens of the last finished stream (stop token included)

    def _decode_window(self, codes: list[int]) -> np.ndarray | None:
        layers = [c.to(self.device) for c in frames_to_snac_codes(codes)]
        if any(bool(((c < 0) | (c >= CODEBOOK)).any()) for c in layers):
            return None  # the official decoder drops windows with out-of-range codes
        with torch.inference_mode():
            audio = self.snac.decode(layers)
        return audio[0, 0, 2048:4096].float().cpu().numpy()

    def stream(self, text: str, voice: str = "tara", temperature: float = 0.6, top_p: float = 0.8,
               repetition_penalty: float = 1.3, max_tokens: int = 1200, seed: int | None = None,
               constrain_audio: bool = True) -> Iterator[np.ndarray]:
        from transformers import StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        prompt = orpheus_prompt_ids(self.tokenizer, text, voice)
        self.generated_tokens = 0
        input_ids = torch.tensor([prompt], device=self.device)
        chunks: queue.Queue = queue.Queue()
        done = object()
        cancelled = threading.Event()
        decode_window = self._decode_window

        class AudioStreamer(BaseStreamer):
            def __init__(self):
                self.seen_prompt = False
                self.codes: list[int] = []

            def put(self, value: torch.Tensor) -> None:
                if not self.seen_prompt:  # generate() first hands us the prompt
                    self.seen_prompt = True
                    return
                for t in value.reshape(-1).tolist():
                    if t < AUDIO_BASE:
                        continue
                    self.codes.append(t - AUDIO_BASE - CODEBOOK * (len(self.codes) % 7))
                    n = len(self.codes)
                    if n % 7 == 0 and n >= 28:
                        audio = decode_window(self.codes[-28:])
                        if audio is not None:
                            chunks.put(audio)

            def end(self) -> None:
                pass

        class Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
                return torch.full((input_ids.shape[0],), cancelled.is_set(), dtype=torch.bool,
                                  device=input_ids.device)

        def run() -> None:
            try:
                if seed is not None:
                    torch.manual_seed(seed)
                with torch.inference_mode():
                    out = self.model.generate(
                        input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                        temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,  # applied by our list
                        logits_processor=_processors(len(prompt), temperature, top_p, repetition_penalty,
                                                     constrain_audio),
                        stopping_criteria=StoppingCriteriaList([Cancelled()]),
                        max_new_tokens=max_tokens, eos_token_id=STOP_ID, pad_token_id=STOP_ID,
                        streamer=AudioStreamer())
                self.generated_tokens = out.shape[1] - len(prompt)
                chunks.put(done)
            except BaseException as e:  # hand the failure to the consumer
                chunks.put(e)

        worker = threading.Thread(target=run, name="naive-orpheus-generate", daemon=True)
        worker.start()
        try:
            while True:
                item = chunks.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancelled.set()  # consumer stopped early (or finished): let generate() return
            worker.join()

    def synthesize(self, text: str, **kwargs) -> tuple[np.ndarray, int]:
        parts = list(self.stream(text, **kwargs))
        audio = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
        return audio.astype(np.float32, copy=False), SAMPLE_RATE


if __name__ == "__main__":
    import soundfile as sf

    model_dir, codec_dir, text, out = sys.argv[1:5]
    audio, sr = NaiveOrpheus(model_dir, codec_dir).synthesize(text, seed=0, max_tokens=300)
    sf.write(out, audio, sr)
    print(f"{out}: {len(audio) / sr:.2f} s")
