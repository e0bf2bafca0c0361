"""The ``relax-hf`` command line: serve, make-tiny-model, bench, gpu-bench, push-bench,
multinode-bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

__all__ = ["SERVER_KEEPALIVE", "build_parser", "main"]

#: Seconds the engine's uvicorn keeps an idle connection: SGLang's value, stated so the order of
#: the data path's limits holds for hf as for SGLang: every client of the engine (the admission
#: server, the manager's control client) reuses an idle connection for less (docs/reliability.md,
#: "Keep-alive, pair by pair").
SERVER_KEEPALIVE = 5


def _serve(args: argparse.Namespace) -> int:
    import faulthandler
    import logging
    import signal

    import torch
    import uvicorn

    from relax_hf.protocol import parse_dist_addr
    from relax_hf.server import ServerConfig, build_app

    if args.nnodes < 1:
        raise ValueError(f"--nnodes: must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank: must be in [0, {args.nnodes}), got {args.node_rank}")
    if args.nnodes > 1:
        parse_dist_addr(args.dist_init_addr, "--dist-init-addr")
    if args.num_continuous_decode_steps < 1:
        raise ValueError(
            f"--num-continuous-decode-steps: must be >= 1 (1: admit at every step), got "
            f"{args.num_continuous_decode_steps}"
        )
    if args.cuda_graph_max_bs_prefill is not None and args.cuda_graph_max_bs_prefill < 16:
        raise ValueError(
            f"--cuda-graph-max-bs-prefill: rows x padded tokens, must be >= 16 (the smallest "
            f"prefill graph); --cuda-graph-backend-prefill disabled turns them off; got "
            f"{args.cuda_graph_max_bs_prefill}"
        )
    # ``kill -USR1 <pid>`` writes every thread's stack to the log (for diagnosing a hang).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    config = ServerConfig(
        model_path=args.model,
        host=args.host,
        port=args.port,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        weights_cpu_backup=args.weights_cpu_backup,
        served_model_name=args.served_model_name,
        weight_version=args.weight_version,
        max_running_requests=args.max_running_requests,
        attn_implementation=args.attn_implementation,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        dist_timeout=args.dist_timeout,
        mem_fraction_static=args.mem_fraction_static,
        max_total_tokens=args.max_total_tokens,
        context_length=args.context_length,
        disable_cuda_graph=args.disable_cuda_graph,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        cuda_graph_backend_prefill=args.cuda_graph_backend_prefill,
        cuda_graph_max_bs_prefill=args.cuda_graph_max_bs_prefill,
        constrained_json_disable_any_whitespace=args.constrained_json_disable_any_whitespace,
        constrained_json_max_whitespace_cnt=args.constrained_json_max_whitespace_cnt,
        enable_torch_compile=args.enable_torch_compile,
        memory_handoff=args.memory_handoff,
        disable_radix_cache=args.disable_radix_cache,
        enable_custom_logit_processor=args.enable_custom_logit_processor,
        enable_cache_report=args.enable_cache_report,
        emulate_cuda_graph=args.emulate_cuda_graph,
        disable_overlap_schedule=args.disable_overlap_schedule,
        num_continuous_decode_steps=args.num_continuous_decode_steps,
        attention_backend=args.attention_backend,
    )
    if args.node_rank > 0:
        from relax_hf.follower import run_follower

        print(
            f"relax-hf: follower node {args.node_rank}/{args.nnodes} of the replica at "
            f"{args.dist_init_addr}; readiness at http://127.0.0.1:{args.port}/health",
            flush=True,
        )
        code = run_follower(config)
        sys.stdout.flush()
        # Skip interpreter teardown: a gloo group whose head is gone must not delay the exit.
        os._exit(code)
    print(
        f"relax-hf: serving {args.model} on {args.device} at http://{args.host}:{args.port}",
        flush=True,
    )
    uvicorn.run(
        build_app(config),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=SERVER_KEEPALIVE,
    )
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from relax_hf.tiny import make_tiny_model

    hf_logging.disable_progress_bar()
    out = make_tiny_model(args.directory, seed=args.seed, size=args.size, dtype=args.dtype)
    print(out)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from relax_hf.bench import format_result, run

    result = run(quick=args.quick)
    print(json.dumps(result) if args.json else format_result(result))
    return 0 if result.get("ok", True) else 1


def _gpu_bench(args: argparse.Namespace) -> int:
    from relax_hf.gpu_bench import format_result, run

    result = run(
        device=args.device,
        quick=args.quick,
        size=args.size,
        mem_fraction=args.mem_fraction_static,
        torch_compile=args.torch_compile,
        settle_s=args.settle_seconds,
        overlap_schedule=not args.disable_overlap_schedule,
        attention_backend=args.attention_backend,
    )
    print(json.dumps(result) if args.json else format_result(result))
    return 0


def _push_bench(args: argparse.Namespace) -> int:
    from relax_hf.push_bench import DEFAULT_BUCKETS, format_result, run

    buckets = [int(float(b) * (1 << 20)) for b in args.bucket_mib] if args.bucket_mib else None
    result = run(
        args.model,
        device=args.device,
        buckets=DEFAULT_BUCKETS if buckets is None else buckets,
        repeats=args.repeats,
        log_dir=args.log_dir,
    )
    print(json.dumps(result) if args.json else format_result(result))
    return 0 if result["ok"] else 1


def _engine_throughput(args: argparse.Namespace) -> int:
    from relax_hf.throughput_bench import format_result, run

    result = run(
        args.model,
        device=args.device,
        concurrency=args.concurrency,
        requests=args.requests,
        prompt_tokens=args.prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        mem_fraction=args.mem_fraction_static,
        max_running_requests=args.max_running_requests,
        disable_cuda_graph=args.disable_cuda_graph,
        log_dir=args.log_dir,
        compare=[v for v in (args.compare or "").split(",") if v],
        rounds=args.rounds,
        shared_prefix_tokens=args.shared_prefix_tokens,
        samples=args.samples_per_prompt,
        num_continuous_decode_steps=args.num_continuous_decode_steps,
        memory_handoff=args.memory_handoff,
    )
    print(json.dumps(result) if args.json else format_result(result))
    return 0


def _multinode_bench(args: argparse.Namespace) -> int:
    from relax_hf.multinode_bench import format_result, run

    result = run(device=args.device, quick=args.quick)
    print(json.dumps(result) if args.json else format_result(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``relax-hf`` argument parser."""
    from relax_hf.options import ATTENTION_BACKENDS

    parser = argparse.ArgumentParser(
        prog="relax-hf", description="Hugging Face engine for Relax (SGLang protocol)."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("serve", help="run one engine server in the foreground")
    p.add_argument(
        "--model", "--model-path", dest="model", required=True, help="checkpoint directory"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--seed", "--random-seed", dest="seed", type=int, default=0)
    p.add_argument(
        "--weights-cpu-backup",
        "--enable-weights-cpu-backup",
        dest="weights_cpu_backup",
        action="store_true",
        help="keep released weights in (pinned) host memory (without it a release discards "
        "them: a push writes them again, or the checkpoint's are read back when needed)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="model id in /v1/models (default: the model path)"
    )
    p.add_argument("--weight-version", default="default", help="initial weight_version")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument(
        "--nnodes", type=int, default=1, help="nodes of this replica (each mirrors the head)"
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="0: the head (serves HTTP); >0: a follower (no public HTTP; --port is its private "
        "readiness port on 127.0.0.1)",
    )
    p.add_argument(
        "--dist-init-addr",
        default=None,
        help="host:port the head hosts the node group at (required with --nnodes > 1)",
    )
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the nodes to join, and for one collective",
    )
    p.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="fraction of the device's memory for the weights and the KV cache pool together, "
        "taken at start (SGLang's meaning; default 0.88 on CUDA; on CPU the default is a pool "
        "of 32768 tokens)",
    )
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV cache pool size in tokens (overrides --mem-fraction-static)",
    )
    p.add_argument(
        "--context-length", type=int, default=None, help="default: the model's max positions"
    )
    p.add_argument(
        "--disable-cuda-graph",
        "--disable-decode-cuda-graph",
        dest="disable_cuda_graph",
        action="store_true",
        help="run decode steps eagerly instead of replaying captured CUDA graphs",
    )
    p.add_argument(
        "--emulate-cuda-graph",
        action="store_true",
        help="CPU: run decode steps through the CUDA-graph machinery (capture, replay, kept "
        "across release and resume) with eager stand-ins; for tests without a GPU",
    )
    p.add_argument(
        "--memory-handoff",
        action="store_true",
        help="CUDA: a release parks the weights' and the KV cache pool's GPU memory for the next "
        "engine on the same GPU to take over (instead of freeing it to the driver), and a "
        "resume takes parked memory first; for engines that time-share a GPU (docs/hf-engine.md)",
    )
    p.add_argument(
        "--cuda-graph-max-bs",
        "--cuda-graph-max-bs-decode",
        dest="cuda_graph_max_bs",
        type=int,
        default=None,
        help="largest decode batch captured as a CUDA graph (default: --max-running-requests)",
    )
    p.add_argument(
        "--cuda-graph-backend-prefill",
        choices=("full", "disabled"),
        default="full",
        help="prefill steps of a few prompts after cached prefixes: replayed from whole-step "
        "CUDA graphs (full, where decode graphs are on) or run eagerly (disabled); SGLang's "
        "flag, whose breakable backend this engine does not have",
    )
    p.add_argument(
        "--cuda-graph-max-bs-prefill",
        type=int,
        default=None,
        help="rows x padded tokens a prefill CUDA graph holds at most (default: 2048); larger "
        "prefills run eagerly",
    )
    p.add_argument(
        "--constrained-json-disable-any-whitespace",
        action="store_true",
        help="JSON-schema output without free whitespace (compact)",
    )
    p.add_argument(
        "--constrained-json-max-whitespace-cnt",
        type=int,
        default=None,
        help="most consecutive whitespace characters in JSON-schema output (default: unbounded)",
    )
    p.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="fuse the decode step's element-wise parts with torch.compile (CUDA; needs triton)",
    )
    p.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default=None,
        help="the decode step's attention: triton (each row's positions read in place from "
        "the KV cache pool; CUDA, needs triton) or torch_native (the rows' contexts gathered, "
        "then SDPA); default: triton where it can run, else torch_native (SGLang's flag)",
    )
    p.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="no prefix cache: every prompt is prefilled in full (SGLang's flag)",
    )
    p.add_argument(
        "--enable-custom-logit-processor",
        action="store_true",
        help="let requests carry a custom_logit_processor (serialized code the engine runs on "
        "their logits; SGLang's flag). Off: such requests are refused",
    )
    p.add_argument(
        "--enable-cache-report",
        action="store_true",
        help="report the prefix cache's cached_tokens in the OpenAI routes' "
        "usage.prompt_tokens_details (SGLang's flag)",
    )
    p.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="start a decode step only once the last one's tokens are appended, checked and "
        "delivered (default: the next step of a run starts first, so the device computes it "
        "meanwhile; SGLang's flag)",
    )
    p.add_argument(
        "--num-continuous-decode-steps",
        type=int,
        default=1,
        help="while sequences run, admit new requests at most once every N steps, so that "
        "requests arriving one by one are prefilled together in fewer, larger steps; an "
        "arrival waits at most N - 1 steps, none when nothing runs or the arrivals fill the "
        "batch (SGLang's flag; default 1: at every step)",
    )
    p.add_argument("--log-level", default="warning")
    p.set_defaults(_run=_serve)

    p = sub.add_parser(
        "make-tiny-model", help="write a tiny random-initialised model with a local tokenizer"
    )
    p.add_argument("directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", default="tiny", choices=["tiny", "micro", "small"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(_run=_make_tiny)

    p = sub.add_parser("bench", help="CPU throughput at concurrency 1 and 16 (batching speed-up)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help="shorter run")
    p.set_defaults(_run=_bench)

    p = sub.add_parser(
        "gpu-bench", help="~1B model on CUDA: memory release, resume speed, update throughput"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke test)")
    p.add_argument(
        "--size",
        default=None,
        choices=["1b", "tiny"],
        help="model size (default: 1b on cuda, tiny on cpu)",
    )
    p.add_argument(
        "--mem-fraction-static", type=float, default=0.85, help="the engine's (CUDA only; 0.85)"
    )
    p.add_argument(
        "--torch-compile", action="store_true", help="start the engine with --enable-torch-compile"
    )
    p.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="start the engine with --disable-overlap-schedule (decode steps one after another)",
    )
    p.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default=None,
        help="the engine's decode attention (default: its own choice)",
    )
    p.add_argument(
        "--settle-seconds",
        type=float,
        default=2.0,
        help="wait between a release and the resume that is timed (as between two RL steps)",
    )
    p.add_argument("--quick", action="store_true")
    p.set_defaults(_run=_gpu_bench)

    p = sub.add_parser(
        "push-bench",
        help="a bucketed weight push into an engine (CUDA IPC flattened buckets; safetensors "
        "on CPU) per bucket size, against a pinned H2D and a D2D copy of the same bytes",
    )
    p.add_argument("model", help="a checkpoint directory (make-tiny-model … --size small)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke test)")
    p.add_argument(
        "--bucket-mib",
        nargs="+",
        type=float,
        help="bucket sizes in MiB, 0 for the whole model (default: 64 256 512 1024 0)",
    )
    p.add_argument("--repeats", type=int, default=3, help="pushes per bucket size (median)")
    p.add_argument("--log-dir", default=None, help="where the engine's log goes (default: temp)")
    p.set_defaults(_run=_push_bench)

    p = sub.add_parser(
        "engine-throughput",
        help="one engine's own generation tokens/s at a step's concurrency and lengths "
        "(against a phase's, from relax run --measure)",
    )
    p.add_argument("model", help="a checkpoint directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--concurrency", type=int, default=256, help="requests in flight (256)")
    p.add_argument("--requests", type=int, default=256, help="requests timed (256)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (64)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens each (128)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (1.0)")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="as the job's")
    p.add_argument("--max-running-requests", type=int, default=None, help="as the job's")
    p.add_argument("--disable-cuda-graph", action="store_true", help="eager decode")
    p.add_argument("--log-dir", default=None, help="where the engine's log goes (default: temp)")
    p.add_argument(
        "--compare",
        default="",
        help="comma-separated variants measured after the random prompts, as a phase sends "
        "its requests: shared-prefix, chat, rollout (see docs/hf-engine.md)",
    )
    p.add_argument("--rounds", type=int, default=1, help="baseline and variants, in turn (1)")
    p.add_argument(
        "--num-continuous-decode-steps",
        type=int,
        default=1,
        help="the engine's flag, as the phase's engine has it (1)",
    )
    p.add_argument(
        "--memory-handoff",
        action="store_true",
        help="the engine's flag, as the phase's engine has it (CUDA); the engine releases and "
        "resumes all its memory once after the warm-up, as a phase of relax run finds it",
    )
    p.add_argument(
        "--shared-prefix-tokens", type=int, default=64, help="shared-prefix: tokens shared (64)"
    )
    p.add_argument(
        "--samples-per-prompt", type=int, default=8, help="rollout: samples a request (8)"
    )
    p.set_defaults(_run=_engine_throughput)

    p = sub.add_parser(
        "multinode-bench",
        help="a two-node replica (head cuda:0, follower cuda:1) against one engine: speed, "
        "updates, failure detection",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test")
    p.add_argument("--quick", action="store_true")
    p.set_defaults(_run=_multinode_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``relax-hf`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args))
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as exc:
        print(f"relax-hf {args.command}: error: {exc}", file=sys.stderr)
        return 2
