"""The HTTP face of the engine: SGLang's native routes on Starlette.

:func:`build_app` wires an :class:`~relax_hf.engine.Engine` (built at start-up from a
:class:`ServerConfig`) into a Starlette app. Bad input answers 400 naming the field; released
memory answers 503 with ``Retry-After``; a refused lifecycle operation answers 400 with
``{"success": false, "message": …}``.

With ``nnodes`` > 1 this is the head of a multi-node replica: before the port opens it hosts the
node group at ``dist_init_addr`` and waits until every follower joined (:mod:`relax_hf.nodes`).
Once a follower is lost, ``/health`` and ``/health_generate`` answer 503 naming it, and
generation and lifecycle calls answer 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import attrs
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

import relax_hf
from relax_hf import openai_api, responses_api, scoring, tokenizer_api
from relax_hf.engine import Engine, NotResident
from relax_hf.nodes import HeadNodes, fingerprint
from relax_hf.protocol import (
    BadRequest,
    LogprobParams,
    NotFound,
    SamplingParams,
    parse_generate,
    parse_tags,
)
from relax_hf.runner import ModelRunner
from relax_hf.wire import (
    SSE_DONE,
    AnswerResponse,
    check_sampling_mask,
    check_total_tokens,
    encode_prompt,
    engine_of,
    error_response,
    guard,
    not_resident,
    read_json,
    sse,
)

__all__ = ["ServerConfig", "build_app", "error_response", "read_json"]


@attrs.frozen
class ServerConfig:
    """What ``relax-hf serve`` starts: one model on one device (one node of a replica)."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "cpu"
    dtype: str = "auto"
    seed: int = 0
    weights_cpu_backup: bool = False
    served_model_name: str | None = None
    weight_version: str = "default"
    max_running_requests: int = 64
    attn_implementation: str = "sdpa"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: float = 300.0
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    context_length: int | None = None
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    cuda_graph_backend_prefill: str = "full"
    cuda_graph_max_bs_prefill: int | None = None
    constrained_json_disable_any_whitespace: bool = False
    constrained_json_max_whitespace_cnt: int | None = None
    enable_torch_compile: bool = False
    memory_handoff: bool = False
    disable_radix_cache: bool = False
    enable_custom_logit_processor: bool = False
    enable_cache_report: bool = False
    emulate_cuda_graph: bool = False
    disable_overlap_schedule: bool = False
    num_continuous_decode_steps: int = 1
    attention_backend: str | None = None


# -- generation -------------------------------------------------------------------------------


async def generate(request: Request) -> Response:
    engine = engine_of(request)
    req = parse_generate(await read_json(request), vocab_size=engine.runner.vocab_size)
    prompts = [encode_prompt(engine, p) for p in req.prompts]
    for i, (ids, lp) in enumerate(zip(prompts, req.logprobs, strict=True)):
        if lp.return_logprob and lp.logprob_start_len >= len(ids):
            raise BadRequest(
                "logprob_start_len",
                f"must be < the prompt length ({len(ids)} tokens of prompt {i})",
            )
    fields = [
        f"sampling_params[{i}]" if req.batch else "sampling_params" for i in range(len(prompts))
    ]
    for ids, sp, field, explicit in zip(
        prompts, req.sampling, fields, req.explicit_max, strict=True
    ):
        if explicit:
            check_total_tokens(engine, len(ids), sp.max_new_tokens)
        await engine.check_grammar(sp, field)
    for sp, lp, field in zip(req.sampling, req.logprobs, fields, strict=True):
        check_sampling_mask(sp, lp, field)
    listed = req.batch or req.n > 1  # SGLang answers a list for a batch or n > 1
    if req.stream:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        rids: list[str] = []
        try:
            for ids, sp, lp, rid, field, proc in zip(
                prompts, req.sampling, req.logprobs, req.rids, fields, req.processors, strict=True
            ):
                subs = engine.submit(
                    ids, sp, lp, rid=rid, stream=True, field=field, queue=queue, processor=proc
                )
                rids += [seq.rid for seq, _ in subs]
        except BaseException:
            for r in rids:
                engine.abort(r, "Abort: another prompt of the batch was refused")
            raise
        return StreamingResponse(
            _stream(engine, rids, queue, indexed=listed), media_type="text/event-stream"
        )
    results = await asyncio.gather(
        *(
            engine.generate(ids, sp, lp, rid, processor=proc)
            for ids, sp, lp, rid, proc in zip(
                prompts, req.sampling, req.logprobs, req.rids, req.processors, strict=True
            )
        )
    )
    flat = [r for res in results for r in res]
    return AnswerResponse(flat if listed else flat[0])


async def _stream(
    engine: Engine, rids: list[str], queue: asyncio.Queue[dict[str, Any]], *, indexed: bool
) -> AsyncIterator[bytes]:
    index = {rid: i for i, rid in enumerate(rids)}
    open_ = set(rids)
    try:
        while open_:
            snap = await queue.get()
            rid = snap["meta_info"]["id"]
            if snap["meta_info"]["finish_reason"] is not None:
                open_.discard(rid)
            if indexed:
                snap["index"] = index[rid]
            yield sse(snap)
        yield SSE_DONE
    finally:
        for rid in open_:
            engine.abort(rid, "Abort: the client went away")


async def health(request: Request) -> Response:
    broken = engine_of(request).broken
    if broken:
        return error_response(503, f"this multi-node replica is unhealthy: {broken}")
    return Response(status_code=200)


async def health_generate(request: Request) -> Response:
    return await _generation_check(engine_of(request)) or Response(status_code=200)


async def _generation_check(engine: Any) -> Response | None:
    """One greedy token from a one-token prompt; ``None`` once it came, else the 503 (or the
    not-resident answer) saying why not."""
    if engine.broken:
        return error_response(503, f"this multi-node replica is unhealthy: {engine.broken}")
    if engine.paused:
        return error_response(503, "generation is paused", headers={"Retry-After": "1"})
    prompt = [engine.runner.pad_id if engine.runner.pad_id < engine.runner.vocab_size else 0]
    try:
        out = await asyncio.wait_for(
            engine.generate_one(
                prompt,
                SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True),
                LogprobParams(),
                check=True,
            ),
            timeout=60.0,
        )
    except NotResident as exc:
        return not_resident(exc)
    except TimeoutError:
        return error_response(503, "health generation timed out after 60s")
    if out["meta_info"]["completion_tokens"] != 1:
        return error_response(
            503, f"health generation did not finish: {out['meta_info']['finish_reason']}"
        )
    return None


# -- info -----------------------------------------------------------------------------------


def prefix_cache_info(engine: Engine) -> dict[str, Any]:
    """The prefix cache's state and hit counters (``/server_info`` ``prefix_cache``).

    ``cached_tokens_total`` is the sum of the sequences' ``cached_tokens`` and
    ``prompt_tokens_total`` the sum of their prompt lengths (each sample counts, at its first
    prefill); ``hit_rate`` is their ratio (0 before any prompt).
    """
    batch = engine.batch
    looked_up = batch.prompt_tokens_prefilled
    return {
        **engine.runner.prefix_cache.report(),
        "cached_tokens_total": batch.cached_tokens_total,
        "prompt_tokens_total": looked_up,
        "hit_rate": batch.cached_tokens_total / looked_up if looked_up else 0.0,
    }


def server_info_dict(engine: Engine, config: ServerConfig) -> dict[str, Any]:
    """Server args plus internal state (what routers and managers read)."""
    runner = engine.runner
    cache = prefix_cache_info(engine)
    return {
        **attrs.asdict(config),
        "model_path": config.model_path,
        "tokenizer_path": config.model_path,
        "attention_backend": runner.attention_backend,  # the one chosen (flag: none = auto)
        "served_model_name": engine.served_model_name,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "nodes": engine.nodes.status() if engine.nodes is not None else None,
        "random_seed": config.seed,
        "enable_weights_cpu_backup": config.weights_cpu_backup,
        "context_length": runner.max_len,
        "version": relax_hf.__version__,
        "engine": "relax-hf",
        "weight_version": engine.weight_version,
        "resident": dict(engine.resident),
        "paused": engine.paused,
        "num_running_reqs": engine.num_running,
        "num_waiting_reqs": engine.num_waiting,
        "peak_running_reqs": engine.batch.peak_running,
        "max_total_num_tokens": runner.pool.capacity,
        "prefill_tokens_total": engine.batch.prefill_tokens,
        "prefill_sequences_total": engine.batch.prefill_sequences,
        "decode_steps_total": engine.batch.decode_steps,
        "decode_steps_ahead_total": engine.batch.ahead_steps,
        "decode_steps_ahead_dropped_total": engine.batch.ahead_dropped,
        "prefill_steps_total": engine.batch.prefill_steps,
        "step_seconds_total": round(engine.step_seconds, 6),
        # runs of steps the compute thread took between two hand-overs to the scheduler loop
        "scheduler_runs_total": engine.runs,
        # Python's garbage collector: the start-up objects frozen out of its full collections
        # (ModelRunner.freeze_heap) and the collections of each generation so far.
        "gc": {
            "frozen_objects": ModelRunner.frozen_objects,
            "collections": [g["collections"] for g in gc.get_stats()],
        },
        "generation_tokens_total": engine.batch.tokens_generated,
        "prefix_cache": cache,
        "memory": runner.memory_report(),
        "last_release": engine.last_release,
        "last_resume": engine.last_resume,
        "memory_log": list(engine.memory_log),
        "weights_update_group": engine.group.name,
        "pid": os.getpid(),
        "startup_time": engine.startup_seconds,
        "internal_states": [
            {
                "num_running_reqs": engine.num_running,
                "weight_version": engine.weight_version,
                "startup_time": runner.startup_time,  # the scheduler's, as SGLang's
                "cache_hit_rate": cache["hit_rate"],
                "memory_usage": memory_usage(engine),
            }
        ],
    }


def memory_usage(engine: Engine) -> dict[str, Any]:
    """SGLang's ``internal_states[].memory_usage`` (its ``build_memory_usage``): weights and KV
    cache pool in GiB (resident now), the device's free GiB once started, the pool's token
    capacity, no sliding-window capacity (``token_capacity_swa``: the engine refuses sliding
    windows), and each CUDA-graph phase's GiB at start-up."""
    runner = engine.runner
    report = runner.memory_report()
    gib = float(1 << 30)
    return {
        "weight": round(report["resident_param_bytes"] / gib, 3),
        "kvcache": round(report["kv_cache"]["bytes"] / gib, 3),
        "startup_available": round(runner.startup_available_gib, 3),
        "token_capacity": runner.pool.capacity,
        "token_capacity_swa": None,
        "graph": {phase: round(v, 3) for phase, v in runner.graph_memory_gib.items()},
    }


async def server_info(request: Request) -> Response:
    engine = engine_of(request)
    info = await engine.compute(server_info_dict, engine, request.app.state.config, reads_only=True)
    return JSONResponse(info)


async def model_info(request: Request) -> Response:
    engine = engine_of(request)
    runner = engine.runner
    return JSONResponse(
        {
            # SGLang's: the checkpoint loaded now (it follows update_weights_from_disk).
            "model_path": runner.checkpoint_path,
            "tokenizer_path": runner.model_path,
            "served_model_name": engine.served_model_name,
            "is_generation": True,
            "weight_version": engine.weight_version,
            "model_type": getattr(runner.config, "model_type", None),
            "architectures": getattr(runner.config, "architectures", None),
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }
    )


def _model_card(engine: Engine) -> dict[str, Any]:
    return {
        "id": engine.served_model_name,
        "object": "model",
        "created": int(engine.started),
        "owned_by": "relax-hf",
        "root": engine.runner.model_path,
        "parent": None,
        "max_model_len": engine.runner.max_len,
    }


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(engine_of(request))]})


async def retrieve_model(request: Request) -> Response:
    """``GET /v1/models/{model}``: the served model's card; 404 (SGLang's
    ``model_not_found``) for any other name."""
    engine = engine_of(request)
    name = request.path_params["model"]
    if name != engine.served_model_name:
        raise NotFound(f"The model '{name}' does not exist", param="model", code="model_not_found")
    return JSONResponse(_model_card(engine))


async def version(request: Request) -> Response:
    return JSONResponse({"version": relax_hf.__version__, "engine": "relax-hf"})


async def loads(request: Request) -> Response:
    engine = engine_of(request)
    load = {
        "dp_rank": 0,
        "num_reqs": engine.num_running + engine.num_waiting,
        "num_running_reqs": engine.num_running,
        "num_waiting_reqs": engine.num_waiting,
        "num_tokens": 0,
    }
    return JSONResponse(
        {"timestamp": time.time(), "loads": [load]} if request.url.path == "/loads" else [load]
    )


async def metrics(request: Request) -> Response:
    engine = engine_of(request)
    cache = await engine.compute(prefix_cache_info, engine, reads_only=True)
    name = engine.served_model_name.replace('"', "")
    lines = [
        "# TYPE sglang:num_running_reqs gauge",
        f'sglang:num_running_reqs{{model_name="{name}"}} {engine.num_running}',
        "# TYPE sglang:num_queue_reqs gauge",
        f'sglang:num_queue_reqs{{model_name="{name}"}} {engine.num_waiting}',
        "# TYPE sglang:generation_tokens_total counter",
        f'sglang:generation_tokens_total{{model_name="{name}"}} {engine.batch.tokens_generated}',
        "# TYPE sglang:num_requests_total counter",
        f'sglang:num_requests_total{{model_name="{name}"}} {engine.requests_total}',
        "# TYPE sglang:prompt_tokens_total counter",
        f'sglang:prompt_tokens_total{{model_name="{name}"}} {engine.prompt_tokens_total}',
        "# TYPE relax_hf:prefill_tokens_total counter",
        f'relax_hf:prefill_tokens_total{{model_name="{name}"}} {engine.batch.prefill_tokens}',
        "# TYPE relax_hf:prefill_sequences_total counter",
        f'relax_hf:prefill_sequences_total{{model_name="{name}"}} {engine.batch.prefill_sequences}',
        "# TYPE sglang:token_usage gauge",
        f'sglang:token_usage{{model_name="{name}"}} {engine.token_usage():.6f}',
        "# TYPE sglang:cache_hit_rate gauge",
        f'sglang:cache_hit_rate{{model_name="{name}"}} {cache["hit_rate"]:.6f}',
        "# TYPE sglang:cached_tokens_total counter",
        f'sglang:cached_tokens_total{{model_name="{name}",cache_source="device"}} '
        f"{cache['cached_tokens_total']}",
        "# TYPE relax_hf:prefix_cache_tokens gauge",
        f'relax_hf:prefix_cache_tokens{{model_name="{name}"}} {cache["tokens"]}',
        "# TYPE relax_hf:prefix_cache_evicted_tokens_total counter",
        f'relax_hf:prefix_cache_evicted_tokens_total{{model_name="{name}"}} '
        f"{cache['evicted_tokens_total']}",
    ]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


# -- control --------------------------------------------------------------------------------


def ok(message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": True, "message": message, **extra})


async def abort_request(request: Request) -> Response:
    engine = engine_of(request)
    body = await read_json(request, optional=True) or {}
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    if body.get("abort_all"):
        return ok(f"Aborted {engine.abort_all()} request(s).")
    rid = body.get("rid")
    if not isinstance(rid, str) or not rid:
        raise BadRequest("rid", "a non-empty request id (or abort_all: true) is required")
    found = engine.abort(rid)
    return ok("Aborted." if found else f"No request {rid!r} in flight.", found=found)


async def flush_cache(request: Request) -> Response:
    return ok(await engine_of(request).flush_cache())


async def pause_generation(request: Request) -> Response:
    body = await read_json(request, optional=True) or {}
    mode = body.get("mode", "abort") if isinstance(body, dict) else "abort"
    return ok(await engine_of(request).pause(mode))


async def continue_generation(request: Request) -> Response:
    return ok(engine_of(request).resume_generation())


async def release_memory(request: Request) -> Response:
    tags = parse_tags(await read_json(request, optional=True))
    detail = await engine_of(request).release(tags)
    return ok(f"Released {list(tags)}.", tags=list(tags), detail=detail)


async def resume_memory(request: Request) -> Response:
    body = await read_json(request, optional=True)
    tags = parse_tags(body)
    # Relax's own field (the manager's onload in one call): once resumed, check one generation
    # as /health_generate does, and answer its 503 if it fails (the tags stay resumed).
    check = _flag(body, "check_generation", False) if isinstance(body, dict) else False
    engine = engine_of(request)
    detail = await engine.resume(tags)
    if check:
        began, stepped = time.perf_counter(), engine.step_seconds
        failed = await _generation_check(engine)
        if failed is not None:
            return failed
        # In the memory log's entry too (the same dict): what the check added to the resume,
        # and of it the compute thread's seconds in steps (the rest: the loop's hand-overs).
        detail["generation_check_seconds"] = time.perf_counter() - began
        detail["generation_check_step_seconds"] = engine.step_seconds - stepped
    message = detail.get("weights", {}).get("message") or f"Resumed {list(tags)}."
    extra = {"generation_checked": True} if check else {}
    return ok(
        message, tags=list(tags), detail=detail, weight_version=engine.weight_version, **extra
    )


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(key, f"must be true or false, got {value!r}")
    return value


async def _body_object(request: Request) -> dict[str, Any]:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    return body


async def update_weights_from_tensor(request: Request) -> Response:
    engine = engine_of(request)
    body = await _body_object(request)
    detail = await engine.update_from_tensor(
        body.get("serialized_named_tensors"),
        body.get("load_format"),
        abort_all_requests=_flag(body, "abort_all_requests", False),
        weight_version=body.get("weight_version"),
    )
    return ok(
        "Succeeded to update model weights.", weight_version=engine.weight_version, detail=detail
    )


async def update_weights_from_disk(request: Request) -> Response:
    engine = engine_of(request)
    body = await _body_object(request)
    detail = await engine.update_from_disk(
        body.get("model_path"),
        abort_all_requests=_flag(body, "abort_all_requests", False),
        weight_version=body.get("weight_version"),
    )
    return ok(
        "Succeeded to update model weights.", weight_version=engine.weight_version, detail=detail
    )


async def init_weights_update_group(request: Request) -> Response:
    body = await _body_object(request)
    await engine_of(request).init_group(body)
    return ok("Succeeded to initialize custom process group.")


async def update_weights_from_distributed(request: Request) -> Response:
    engine = engine_of(request)
    body = await _body_object(request)
    detail = await engine.update_from_distributed(body)
    return ok(
        "Succeeded to update parameter online from distributed.",
        weight_version=engine.weight_version,
        detail=detail,
    )


async def get_weights_by_name(request: Request) -> Response:
    # SGLang's: the parameter's values (first dimension cut to truncate_size), as JSON lists.
    body = await _body_object(request)
    values = await engine_of(request).weights_by_name(
        body.get("name"), body.get("truncate_size", 100)
    )
    return JSONResponse(values)


async def destroy_weights_update_group(request: Request) -> Response:
    body = await read_json(request, optional=True) or {}
    name = body.get("group_name") if isinstance(body, dict) else None
    await engine_of(request).destroy_group(name or "weight_update_group")
    return ok("Succeeded to destroy custom process group.")


# -- the app --------------------------------------------------------------------------------


def build_app(config: ServerConfig, *, engine: Engine | None = None) -> Starlette:
    """The Starlette app; the model loads in the lifespan start-up (before the port opens)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        eng = engine
        if eng is None:
            nodes = None
            if config.nnodes > 1:
                # Host the rendezvous first, so followers can connect while the model loads.
                nodes = await asyncio.to_thread(
                    HeadNodes.listen, config.dist_init_addr, config.nnodes, config.dist_timeout
                )
            try:
                runner = await asyncio.to_thread(ModelRunner.from_config, config)
                if runner.graphs_note is not None:
                    print(f"relax-hf: {runner.graphs_note}", flush=True)
                if nodes is not None:
                    await asyncio.to_thread(nodes.join, fingerprint(runner))
            except BaseException:
                if nodes is not None:
                    nodes.close()
                raise
            eng = Engine(
                runner,
                served_model_name=config.served_model_name or config.model_path,
                weight_version=config.weight_version,
                max_running_requests=config.max_running_requests,
                seed=config.seed,
                nodes=nodes,
                enable_custom_logit_processor=config.enable_custom_logit_processor,
                overlap_schedule=not config.disable_overlap_schedule,
                num_continuous_decode_steps=config.num_continuous_decode_steps,
            )
        app.state.engine = eng
        app.state.config = config
        if engine is None:
            frozen = ModelRunner.freeze_heap()
            print(f"relax-hf: {frozen} start-up objects kept out of garbage collection", flush=True)
        eng.start()
        try:
            yield
        finally:
            await eng.stop()

    get, post, both = ["GET"], ["POST"], ["GET", "POST"]
    routes = [
        Route("/health", health, methods=get),
        Route("/health_generate", guard(health_generate), methods=get),
        Route("/server_info", server_info, methods=get),
        Route("/get_server_info", server_info, methods=get),
        Route("/model_info", model_info, methods=get),
        Route("/get_model_info", model_info, methods=get),
        Route("/v1/models", models, methods=get),
        Route("/v1/models/{model:path}", guard(retrieve_model), methods=get),
        Route("/version", version, methods=get),
        Route("/get_load", loads, methods=get),
        Route("/loads", loads, methods=get),
        Route("/metrics", metrics, methods=get),
        Route("/generate", guard(generate), methods=post),
        Route("/abort_request", guard(abort_request), methods=post),
        Route("/flush_cache", guard(flush_cache), methods=both),
        Route("/pause_generation", guard(pause_generation), methods=post),
        Route("/continue_generation", guard(continue_generation), methods=post),
        Route("/release_memory_occupation", guard(release_memory), methods=post),
        Route("/resume_memory_occupation", guard(resume_memory), methods=post),
        Route("/update_weights_from_tensor", guard(update_weights_from_tensor), methods=post),
        Route("/update_weights_from_disk", guard(update_weights_from_disk), methods=post),
        Route("/init_weights_update_group", guard(init_weights_update_group), methods=post),
        Route(
            "/update_weights_from_distributed",
            guard(update_weights_from_distributed),
            methods=post,
        ),
        Route("/destroy_weights_update_group", guard(destroy_weights_update_group), methods=post),
        Route("/get_weights_by_name", guard(get_weights_by_name), methods=both),
        Route("/v1/chat/completions", guard(openai_api.chat_completions), methods=post),
        Route("/v1/completions", guard(openai_api.completions), methods=post),
        Route("/v1/responses", guard(responses_api.create_response), methods=post),
        Route("/v1/responses/{response_id}", guard(responses_api.retrieve_response), methods=get),
        Route("/v1/score", guard(scoring.score), methods=post),
        Route("/tokenize", guard(tokenizer_api.tokenize), methods=post),
        Route("/v1/tokenize", guard(tokenizer_api.tokenize), methods=post),
        Route("/detokenize", guard(tokenizer_api.detokenize), methods=post),
        Route("/v1/detokenize", guard(tokenizer_api.detokenize), methods=post),
    ]
    return Starlette(routes=routes, lifespan=lifespan)
