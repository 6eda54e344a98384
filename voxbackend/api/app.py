"""The HTTP service: OpenAI's speech endpoints, a WebSocket for incremental text, health, gauges, the player.

It talks to tritonserver only (gRPC streaming for audio, its metrics port for gauges) and loads no model.

    POST /v1/audio/speech          OpenAI fields + sampling extras -> audio streamed as it is produced
    POST /v1/chat/completions      a conversation model's spoken (or text) reply, whole or as events (chat.py)
    GET  /v1/audio/voices          each served model's voices
    GET  /v1/models                the served speech models (OpenAI list shape, plus voices, sample rate, guidance)
    WS   /v1/audio/speech/stream   text pieces in, PCM16 audio frames out (speech_socket.py)
    GET  /v1/stats                 the engines' gauges (active streams, queue, KV pages, alive) as JSON
    GET  /health                   200 when Triton is ready and every engine is alive, else 503
    GET  /                         the browser player (static/)
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError

from voxbackend.api import gauges
from voxbackend.api.audio_out import AudioEncoder
from voxbackend.api.catalog import Catalog
from voxbackend.api.chat import ChatReply, unless_disconnected
from voxbackend.api.chat_request import ChatRequest
from voxbackend.api.errors import ApiError, bad_request, unavailable
from voxbackend.api.replies import Transcripts
from voxbackend.api.requests import SpeechRequest, validation_error
from voxbackend.api.speech_socket import SpeechSocket
from voxbackend.api.triton_stream import AudioChunk, SpeechStream, speech_inputs

STATIC = Path(__file__).parent / "static"
log = logging.getLogger("voxbackend.api")


def create_app(triton_url: str, metrics_url: str | None = None, prefetch_voices: bool = True) -> FastAPI:
    """triton_url: Triton's gRPC address (host:port); metrics_url: its Prometheus endpoint (http://...:8002/metrics)."""
    catalog = Catalog(triton_url)
    transcripts = Transcripts()  # spoken replies' transcripts, for assistant messages that give an audio.id

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(_prefetch(catalog)) if prefetch_voices else None
        yield
        if task:
            task.cancel()

    app = FastAPI(title="voxbackend speech API", lifespan=lifespan)
    app.state.catalog = catalog

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
        error = validation_error(list(e.errors()))
        return JSONResponse(error.body(), status_code=error.status)

    @app.post("/v1/audio/speech")
    async def speech(body: SpeechRequest):
        body.check_unsupported()
        model, voice = body.resolve(await catalog.models())
        encoder = AudioEncoder(body.response_format)
        stream = SpeechStream(triton_url, model.name, speech_inputs(body.input, model.voice_input, voice,
                                                                    body.sampling(), body.model_inputs(model)))
        try:
            first = await stream.next()  # errors before any audio get a proper status (400, 429, 503)
        except BaseException:
            await stream.close()
            raise
        return SpeechResponse(stream, _audio_body(stream, encoder, first), media_type=encoder.media_type,
                              headers={"X-Sample-Rate": str(stream.sample_rate)})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:  # read here, not by FastAPI: a refusal names the nested field (audio.format), not only "audio"
            body = ChatRequest.model_validate(await request.json())
        except ValidationError as e:
            raise validation_error(e, nested=True) from None
        except ValueError:  # json.JSONDecodeError, UnicodeDecodeError
            raise bad_request("the body must be a JSON object", None) from None
        reply = await ChatReply.open(body, catalog, triton_url, transcripts)
        if body.stream:
            return SpeechResponse(reply.stream, reply.events(), media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache"})
        try:
            completion = await unless_disconnected(request.receive, reply.complete())
        finally:
            await reply.stream.close()
        return JSONResponse(completion) if completion is not None else Response(status_code=499)

    @app.get("/v1/models")
    async def list_models():
        models = await catalog.models_with_voices()
        return {"object": "list", "data": [m.describe() for m in models.values()]}

    @app.get("/v1/audio/voices")
    async def list_voices():
        models = await catalog.models_with_voices()
        return {"voices": [{"model": m.name, "voice_id": v, "name": v} for m in models.values() for v in m.voices],
                "models": {m.name: {"voices": list(m.voices), "voice_kind": m.describe()["voice_kind"],
                                    **({"error": m.info_error} if m.info_error else {})}
                           for m in models.values()}}

    @app.get("/v1/stats")
    async def stats():
        if not metrics_url:
            raise unavailable("no metrics URL configured", "metrics_unavailable")
        models = await catalog.models()
        try:
            engines = await asyncio.to_thread(gauges.read, metrics_url)
        except OSError as e:
            raise unavailable(f"Triton's metrics endpoint does not answer: {e}", "metrics_unavailable") from None
        return {"models": {m.name: {"engine": m.engine, **engines.get(m.engine, {})} for m in models.values()},
                "engines": engines}

    @app.get("/health")
    async def health():
        report, ok = await _health(catalog, metrics_url)
        return JSONResponse(report, status_code=200 if ok else 503)

    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(ws: WebSocket):
        await SpeechSocket(ws, catalog, triton_url).run()

    @app.get("/", include_in_schema=False)
    async def player():
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


class SpeechResponse(StreamingResponse):
    """A streamed body that hangs up its Triton request however the response ends, even when the client left
    before the body generator ever started (its own finally would then never run)."""

    def __init__(self, stream: SpeechStream, body, **kwargs):
        super().__init__(body, **kwargs)
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.stream.close()


async def _audio_body(stream: SpeechStream, encoder: AudioEncoder, first: AudioChunk | None):
    """The response body: the format's header, then each chunk as it arrives. A client that disconnects cancels
    this generator, and close() then cancels the request in Triton. An error after the first bytes cannot change
    the status any more: the connection is cut (the client sees a truncated transfer) and the error is logged."""
    try:
        yield encoder.start(stream.sample_rate or (first.sample_rate if first else 24000))
        chunk = first
        while chunk is not None:
            data = encoder.add(chunk.pcm16)
            if data:
                yield data
            chunk = await stream.next()
        yield encoder.finish()
    except ApiError as e:
        log.warning("stream failed after its first audio: %s", e)
        raise
    finally:
        await stream.close()


async def _health(catalog: Catalog, metrics_url: str | None) -> tuple[dict, bool]:
    try:
        models = await catalog.models()
    except ApiError as e:
        return {"status": "unavailable", "triton": "not reachable", "error": e.message}, False
    ready = await asyncio.to_thread(_triton_ready, catalog.url)
    report: dict = {"triton": "ready" if ready else "not ready", "models": sorted(models)}
    ok = ready and bool(models)
    if metrics_url:
        try:
            engines = await asyncio.to_thread(gauges.read, metrics_url)
        except OSError as e:
            engines, report["metrics_error"] = {}, str(e)
        report["engines"] = {m.engine: {"alive": engines.get(m.engine, {}).get("engine_alive")}
                             for m in models.values()}
        ok = ok and all(e["alive"] is True for e in report["engines"].values())
    if not models:
        report["error"] = "no speech model is served"
    report["status"] = "ok" if ok else "unavailable"
    return report, ok


def _triton_ready(url: str) -> bool:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        return bool(client.is_server_ready(client_timeout=3))
    except Exception:
        return False
    finally:
        client.close()


async def _prefetch(catalog: Catalog) -> None:
    """Ask the front ends for voices once Triton answers, so the first /v1/audio/voices does not wait for it."""
    for _ in range(600):
        try:
            await catalog.models_with_voices()
            return
        except ApiError:
            await asyncio.sleep(1.0)
