"""A chat request's messages -> one user turn and the conversation before it, in a conversation model's terms (its
front model's TEXT, INPUT_AUDIO, SYSTEM_PROMPT and HISTORY_* tensors: voxbackend.stream_client.make_inputs).

    system / developer messages (before the first turn)   -> the system prompt, joined
    user and assistant messages before the last          -> the history, oldest first
    the last message (a user's)                          -> the turn: its text parts and its input_audio part

A user message's content is a string or parts: `text` and at most one `input_audio` (base64 file bytes; the server
reads WAV, FLAC, OGG and MP3 whatever `format` says). An assistant message is given by its text: its content, or
`audio.transcript`, or `audio.id` of a spoken reply this API gave (replies.py). Whatever the model cannot take is a
400 naming the field's path (`messages[2].content[1].input_audio.data`), and so are Triton's later refusals: the
turn carries the map from the tensors Triton names to those paths.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field

from voxbackend.api.catalog import SpeechModel
from voxbackend.api.errors import bad_request
from voxbackend.api.replies import Transcripts

INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus")


@dataclass
class Message:
    role: str  # user | assistant
    where: str  # its path in the body: messages[i]
    text: str | None = None
    audio: bytes | None = None
    audio_where: str | None = None  # the input_audio part's path


@dataclass
class Turn:
    text: str | None = None
    audio: bytes | None = None
    system: str | None = None
    history: list[dict] = field(default_factory=list)  # make_inputs's form: {"role", "text", "audio"}
    params: dict[str, str] = field(default_factory=dict)  # what Triton names -> the body's field (errors.py)


def conversation(messages: list, model: SpeechModel, transcripts: Transcripts) -> Turn:
    if not messages:
        raise bad_request("messages is empty: give at least the user's turn", "messages")
    system: list[str] = []
    system_where: str | None = None
    turns: list[Message] = []
    for i, raw in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(raw, dict):
            raise bad_request(f"{where} must be an object with a role", where)
        role = raw.get("role")
        if role in ("system", "developer"):
            if turns:
                raise bad_request(f"{where}: a {role} message after the conversation started; the model takes one "
                                  "system prompt, before the first turn", f"{where}.role", "unsupported_value")
            system.append(_text_only(raw.get("content"), where))
            system_where = system_where or f"{where}.content"
        elif role == "user":
            turns.append(_user(raw, where))
        elif role == "assistant":
            turns.append(_assistant(raw, where, transcripts))
        else:
            raise bad_request(f"{where}.role {role!r} is not supported: give system, developer, user or assistant "
                              "messages (no tools)", f"{where}.role", "unsupported_value")
    if not turns or turns[-1].role != "user":
        raise bad_request("the last message must be the user's turn (role user)", "messages")
    *history, last = turns
    turn = Turn(last.text, last.audio, "\n\n".join(system) if system else None,
                [{"role": m.role, "text": m.text, "audio": m.audio} for m in history])
    _check_model_takes(turn, model, last, history, system_where)
    turn.params = _params(last, history, system_where)
    return turn


def _user(raw: dict, where: str) -> Message:
    message = Message("user", where)
    content = raw.get("content")
    if isinstance(content, str):
        message.text = content
    elif isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            at = f"{where}.content[{k}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(_string(part.get("text"), f"{at}.text"))
            elif kind == "input_audio":
                if message.audio is not None:
                    raise bad_request(f"{at}: one input_audio part per message (the model takes one clip a turn)",
                                      at, "unsupported_value")
                message.audio, message.audio_where = _input_audio(part.get("input_audio"), at), f"{at}.input_audio"
            else:
                raise bad_request(f"{at}.type {kind!r} is not supported: give text or input_audio parts",
                                  f"{at}.type", "unsupported_value")
        message.text = "\n".join(texts) if texts else None
    else:
        raise bad_request(f"{where}.content must be a string or a list of text and input_audio parts",
                          f"{where}.content")
    if message.audio is None and not (message.text or "").strip():
        raise bad_request(f"{where}.content is empty: give text, input_audio or both", f"{where}.content")
    return message


def _assistant(raw: dict, where: str, transcripts: Transcripts) -> Message:
    if raw.get("tool_calls") or raw.get("function_call"):
        raise bad_request(f"{where}: tool calls are not supported", f"{where}.tool_calls", "unsupported_value")
    content, audio = raw.get("content"), raw.get("audio")
    text = _text_only(content, where) if content not in (None, "", []) else None
    if text is None and isinstance(audio, dict):
        if audio.get("transcript") is not None:
            text = _string(audio["transcript"], f"{where}.audio.transcript")
        elif audio.get("id") is not None:
            text = transcripts.get(str(audio["id"]))
            if text is None:
                raise bad_request(f"{where}.audio.id {audio['id']!r} is no spoken reply of this server, or it expired; "
                                  "give the reply's text as content instead", f"{where}.audio.id")
    if text is None or not text.strip():
        raise bad_request(f"{where}: an assistant turn is given by its text: content, or audio.id of a reply of this "
                          "server (its transcript)", f"{where}.content")
    return Message("assistant", where, text)


def _text_only(content, where: str) -> str:
    """A system or assistant message's content: a string or text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            at = f"{where}.content[{k}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "refusal"):
                raise bad_request(f"{at}.type {kind!r}: this message takes text parts only", f"{at}.type",
                                  "unsupported_value")
            texts.append(_string(part.get(kind), f"{at}.{kind}"))
        return "\n".join(texts)
    raise bad_request(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _string(value, where: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{where} must be a string", where)
    return value


def _input_audio(value, at: str) -> bytes:
    if not isinstance(value, dict):
        raise bad_request(f"{at}.input_audio must be an object with data (base64) and format", f"{at}.input_audio")
    fmt = value.get("format")
    if fmt is not None and fmt not in INPUT_AUDIO_FORMATS:
        raise bad_request(f"{at}.input_audio.format {fmt!r} is not supported; give one of "
                          f"{', '.join(INPUT_AUDIO_FORMATS)}", f"{at}.input_audio.format", "unsupported_value")
    data = value.get("data")
    if not isinstance(data, str) or not data.strip():
        raise bad_request(f"{at}.input_audio.data must be the clip's bytes in base64", f"{at}.input_audio.data")
    if data.startswith("data:") and "," in data:  # a data: URL, as browsers write one
        data = data.split(",", 1)[1]
    try:
        clip = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{at}.input_audio.data is not valid base64", f"{at}.input_audio.data") from None
    if not clip:
        raise bad_request(f"{at}.input_audio.data is empty", f"{at}.input_audio.data")
    return clip


def _check_model_takes(turn: Turn, model: SpeechModel, last: Message, history: list[Message],
                       system_where: str | None) -> None:
    """Refuse, naming the field, what the model's config has no input for."""
    takes = set(model.inputs)
    if turn.audio is not None and "INPUT_AUDIO" not in takes:
        raise bad_request(f"model {model.name!r} takes no audio input", last.audio_where, "unsupported_value")
    if turn.system is not None and "SYSTEM_PROMPT" not in takes:
        raise bad_request(f"model {model.name!r} takes no system prompt", system_where, "unsupported_value")
    if history and "HISTORY_ROLE" not in takes:
        raise bad_request(f"model {model.name!r} takes one turn: no earlier messages", "messages", "unsupported_value")
    with_audio = next((m for m in history if m.audio is not None), None)
    if with_audio and "HISTORY_AUDIO" not in takes:
        raise bad_request(f"model {model.name!r} takes earlier turns as text only", with_audio.audio_where,
                          "unsupported_value")


def _params(last: Message, history: list[Message], system_where: str | None) -> dict[str, str]:
    """The tensors (and the engine's words) Triton's refusals name -> the body's paths."""
    params = {"TEXT": f"{last.where}.content", "INPUT_AUDIO": last.audio_where or f"{last.where}.content",
              "history": "messages", "prompt": "messages", "audio": "messages",
              "HISTORY_ROLE": "messages", "HISTORY_TEXT": "messages", "HISTORY_AUDIO": "messages"}
    if system_where:
        params["SYSTEM_PROMPT"] = params["system"] = system_where
    for j, m in enumerate(history):
        params[f"HISTORY_ROLE[{j}]"] = f"{m.where}.role"
        params[f"HISTORY_TEXT[{j}]"] = f"{m.where}.content"
        params[f"HISTORY_AUDIO[{j}]"] = m.audio_where or f"{m.where}.content"
    return params
