"""The API's routes: health and metrics, the model list, and the completions, chat completions
and Responses endpoints over the engine."""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from flashtree.engine.async_engine import AsyncEngine
from flashtree.server import responses, responses_api
from flashtree.server.errors import ApiError, error_body
from flashtree.server.guard import REQUEST_ID_KEY, STREAM_ENDING_KEY
from flashtree.server.logprob_format import LogprobFormat
from flashtree.server.prompts import PromptBuilder
from flashtree.server.protocol import ChatCompletionRequest, CompletionRequest
from flashtree.server.tool_use import ToolUse
from flashtree.structured_output import GrammarError

if TYPE_CHECKING:
    from flashtree.server.state import ServerConfig, ServerState


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def request_id(request: Request) -> str:
    """The id the Guard gave the request (the log names requests by it)."""
    return request.scope.get(REQUEST_ID_KEY, "-")


def _field_named_by(message: str, body) -> str | None:
    """The request field a library's error message starts with ("n must be ..."), if any."""
    word = message.split(" ", 1)[0].split("=", 1)[0]
    return word if word in type(body).model_fields else None


class Routes:
    """The routes of one server, over its config and state."""

    def __init__(self, cfg: ServerConfig, state: ServerState) -> None:
        self.cfg, self.state = cfg, state
        self.model_card = {"id": cfg.model_name, "object": "model", "created": 0,
                           "owned_by": "flashtree"}

    def add_to(self, app: FastAPI) -> None:
        for path, endpoint, method in (
                ("/health", self.health, "GET"), ("/metrics", self.metrics, "GET"),
                ("/v1/models", self.models, "GET"),
                ("/v1/models/{model_id:path}", self.model, "GET"),
                ("/v1/completions", self.completions, "POST"),
                ("/v1/chat/completions", self.chat, "POST"),
                ("/v1/responses", self.create_response, "POST")):
            # GET routes answer HEAD too (load balancers and benchmark clients probe with it).
            app.add_api_route(path, endpoint, methods=[method, "HEAD"] if method == "GET"
                              else [method])

    async def health(self):
        state = self.state
        if state.load_error is not None:
            return error_response(503, f"model failed to load: {state.load_error}")
        if state.fatal is not None:
            return error_response(503, f"engine stopped: {state.fatal}")
        if state.engine is None:
            return error_response(503, "model is loading")
        return {"status": "ok"}

    async def metrics(self):
        if self.state.engine is not None:
            self.state.metrics.refresh(self.state.engine.engine)
        return Response(generate_latest(self.state.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    async def models(self):
        return {"object": "list", "data": [self.model_card]}

    async def model(self, model_id: str):
        self.check_model(model_id)
        return self.model_card

    async def completions(self, body: CompletionRequest, request: Request):
        engine = self.ready()
        self.check(body)
        params, keep = self.best_of(body, self.params_of(body, 16))
        texts = CompletionRequest.prompt_list(body.prompt)
        ids = await self.prompts.completion(texts, body.max_tokens, body.max_tokens_field)
        tok = self.state.llm.tokenizer
        prompts = [responses.Prompt(
            p, (t if isinstance(t, str) else tok.decode(p, False)) if body.echo else "",
            params.prompt_logprobs is not None) for t, p in zip(texts, ids)]
        return await self.respond(engine, prompts, params, body, "text_completion",
                                  request_id(request), keep=keep)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        engine = self.ready()
        self.check(body)
        tools = ToolUse.of(body, self.state.llm.tokenizer)
        ids = await self.prompts.chat(body.messages, tools, body.max_tokens, "messages",
                                      body.max_tokens_field)
        params = self.params_of(body, None)
        if tools is not None:
            params = tools.constrain(params, body.response_format)
        return await self.respond(engine, [responses.Prompt(ids)], params, body,
                                  "chat.completion", request_id(request), tools)

    async def create_response(self, body: responses_api.ResponsesRequest, request: Request):
        engine = self.ready()
        self.check_model(body.model)
        answer = await responses_api.answer(engine, self.prompts, body, self.cfg.model_name,
                                            self.cfg.max_tokens_limit, request_id(request))
        if isinstance(answer, dict):
            return answer
        # A stream the server cuts ends with the Responses API's own `response.failed`.
        request.scope[STREAM_ENDING_KEY] = lambda message, _code: answer.failed(message)
        return StreamingResponse(answer.events(), media_type="text/event-stream")

    # ------------------------------------------------------------------ checks
    def ready(self) -> AsyncEngine:
        if self.state.fatal is not None:
            raise ApiError(503, f"engine stopped: {self.state.fatal}")
        if self.state.engine is None:
            raise ApiError(503, "model is loading; retry when /health answers 200")
        return self.state.engine

    @functools.cached_property
    def prompts(self) -> PromptBuilder:
        """The served model's prompt builder (made on first use, once the model is ready)."""
        llm = self.state.llm
        return PromptBuilder(llm.tokenizer, llm.engine.args.scheduler.max_model_len,
                             llm.engine.model_cfg.vocab_size)

    def check_model(self, name: str) -> None:
        if name != self.cfg.model_name:
            raise ApiError(404, f"model {name!r} does not exist; available: "
                                f"[{self.cfg.model_name!r}]", "model", "model_not_found")

    def check(self, body) -> None:
        """What a completions or chat request asks that the model and server cannot give."""
        self.check_model(body.model)
        limit = self.cfg.max_tokens_limit
        if body.max_tokens is not None and body.max_tokens > limit:
            raise ApiError(400, f"{body.max_tokens_field}={body.max_tokens} exceeds this "
                                f"server's limit {limit}", body.max_tokens_field)
        self.prompts.check_token_ids(body.stop_token_ids, "stop_token_ids")
        self.prompts.check_plain_text(body.guided_choice, "guided_choice")
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")

    @staticmethod
    def params_of(body, default_max_tokens: int | None):
        try:
            return body.sampling_params(default_max_tokens)
        except ValueError as e:
            raise ApiError(400, str(e), _field_named_by(str(e), body)) from None

    @staticmethod
    def best_of(body: CompletionRequest, params) -> tuple:
        """(the sampling of the best_of candidates, the choices to keep of each prompt)."""
        if body.best_of is None:
            return params, None
        if body.best_of < params.n:
            raise ApiError(400, f"best_of={body.best_of} must be >= n={params.n}", "best_of")
        if body.stream and body.best_of > params.n:
            raise ApiError(400, "best_of > n cannot be streamed", "best_of")
        # Cumulative log-probabilities rank the candidates.
        candidates = dataclasses.replace(params, n=body.best_of, logprobs=params.logprobs or 0)
        return candidates, params.n

    # ------------------------------------------------------------------ answers
    async def respond(self, engine: AsyncEngine, prompts: list[responses.Prompt], params,
                      body, kind: str, rid: str, tools: ToolUse | None = None,
                      keep: int | None = None):
        """Run the request's choices: the whole body, or the stream of its events. Raises
        EngineFailed when the engine fails a choice of a whole body."""
        streams, firsts = await self.start(engine, prompts, params, body)
        fmt = None
        if body.num_logprobs is not None:  # asked for (best_of computes them regardless)
            fmt = LogprobFormat(self.state.llm.tokenizer, body.num_logprobs)
        reply = responses.Reply(
            f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}", rid,
            int(time.time()), kind, self.cfg.model_name, tuple(prompts), body.spec_stats, fmt,
            tools, keep)
        if not body.stream:
            return await responses.body(reply, streams, firsts)
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and options.continuous_usage_stats  # as vLLM: with usage
        return StreamingResponse(
            responses.events(reply, streams, firsts, include_usage, continuous),
            media_type="text/event-stream")

    @staticmethod
    async def start(engine: AsyncEngine, prompts: list[responses.Prompt], params, body):
        """Submit every choice; a request the engine refuses is a 400 naming the field."""
        try:
            return await responses.start(engine, [p.ids for p in prompts], params)
        except GrammarError as e:
            if e.field.startswith("guided_json") and body.response_format is not None:
                raise ApiError(400, str(e).replace(e.field, "response_format", 1),
                               "response_format") from None
            raise ApiError(400, str(e), e.field) from None
        except ValueError as e:  # past the server's checks: prompt + max_tokens over the KV
            raise ApiError(400, str(e), _field_named_by(str(e), body)
                           or body.max_tokens_field) from None
