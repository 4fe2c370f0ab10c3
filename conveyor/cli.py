"""The `conveyor` command line. Each subcommand is an `_add_<name>_command` that registers its parser and handler."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from engine.model_registry import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL

Handler = Callable[[argparse.Namespace], int]
log = logging.getLogger("conveyor")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="conveyor", description="OpenAI-compatible batch inference.")
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run_command(subcommands)
    _add_up_command(subcommands)
    _add_bench_command(subcommands)
    _add_api_command(subcommands)
    _add_worker_command(subcommands)
    _add_beat_command(subcommands)
    _add_db_command(subcommands)
    _add_keys_command(subcommands)
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    return handler(args)


def _add_run_command(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = subcommands.add_parser(
        "run",
        help="run an OpenAI Batch input file (JSONL) locally and write the results file",
        description="Run every request of an OpenAI Batch input file on a local engine. The output has one "
        "line per input line, in input order: a response, or an error record for a line that could not run.",
    )
    run.add_argument("-i", "--input", required=True, type=Path, help="OpenAI Batch input file (JSONL)")
    run.add_argument("-o", "--output", required=True, type=Path, help="where to write the results (JSONL)")
    run.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"model name, .gguf file or model folder (default: {DEFAULT_MODEL})"
    )
    run.add_argument(
        "--embedding-model",
        default=DEFAULT_EMBEDDING_MODEL,
        help=f"what answers /v1/embeddings lines: {DEFAULT_EMBEDDING_MODEL} (default) or a sentence-transformers "
        "folder",
    )
    run.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="NAME=SERVED",
        help="let lines naming NAME (e.g. gpt-4o-mini) be answered by the served model SERVED; repeatable. A line "
        "naming a model not served fails with model_not_found",
    )
    run.add_argument(
        "--lora-adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve the PEFT LoRA adapter folder PATH on the model as NAME: lines naming NAME (or an alias of it) run "
        "with the adapter, mixed in one batch with the model's own lines; repeatable",
    )
    run.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    run.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    run.add_argument("--max-num-seqs", type=int, help="sequences in the running batch at once")
    run.add_argument("--max-num-batched-tokens", type=int, help="tokens computed in one engine step")
    run.add_argument("--kv-cache-memory", type=int, metavar="BYTES", help="KV cache size on CPU, in bytes (per rank)")
    run.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "int8", "fp8_e4m3"],
        help="the KV cache's storage: auto (the model's dtype, the default); int8 (CPU) or fp8_e4m3 (CUDA): 8-bit "
        "values with a float32 scale per token and kv head, ~1.9x bf16's tokens in the same memory",
    )
    run.add_argument(
        "--tensor-parallel-size",
        type=int,
        metavar="N",
        help="shard the model over N processes (GPUs 0..N-1 with --device cuda, or N CPU processes); default 1",
    )
    run.add_argument(
        "-q", "--quiet", action="store_true",
        help="no progress (a bar on a terminal, a line every few seconds otherwise) and no summary; errors only",
    )
    run.add_argument(
        "--quantization",
        choices=["int8", "int4"],
        help="weight-only quantization of an unquantized checkpoint at load (CPU): symmetric groups of 64 input "
        "features, one float32 scale each; default: none (a GGUF file's own blocks run as they are)",
    )
    run.add_argument(
        "--quantized-activations",
        choices=["int8"],
        help="int8: the quantized weights' matmuls (a GGUF's blocks, --quantization, AWQ/GPTQ; CPU) quantize each "
        "token's activations to int8 in blocks of 32 and use integer dot products: faster, the numbers change "
        "slightly; default: none (activations in the model's dtype, the exact path)",
    )
    run.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    input_path: Path = args.input
    output_path: Path = args.output
    # Checked before loading the model, which takes a while, so a typo fails at once.
    if not input_path.is_file():
        return _fail(f"input file not found: {input_path}")
    if not output_path.parent.is_dir():
        return _fail(f"output folder does not exist: {output_path.parent}")
    if output_path.resolve() == input_path.resolve():
        return _fail("the output file must differ from the input file")

    from conveyor.progress import progress_mode, request_progress, show_progress_logs
    from conveyor.run_file import run_batch_file
    from engine import LLM, Embedder
    from engine.model_registry import resolve_embedding_model

    from jobs.served_models import ModelNames, parse_aliases, parse_pairs, process_models

    try:
        resolve_embedding_model(args.embedding_model)  # only found here; loaded if the file has embedding lines
        aliases = parse_aliases(",".join(args.model_alias))
        adapters = parse_pairs(",".join(args.lora_adapter), "--lora-adapter", "NAME=PATH")
    except ValueError as failure:
        return _fail(str(failure))

    engine_options = {
        name: value
        for name, value in (
            ("max_num_seqs", args.max_num_seqs),
            ("max_num_batched_tokens", args.max_num_batched_tokens),
            ("kv_cache_memory", args.kv_cache_memory),
            ("kv_cache_dtype", args.kv_cache_dtype),
            ("tensor_parallel_size", args.tensor_parallel_size),
            ("quantization", args.quantization),
            ("quantized_activations", args.quantized_activations),
            ("enable_lora", True if adapters else None),
        )
        if value is not None
    }
    mode = progress_mode(args.quiet)
    show_progress_logs(mode)
    log.info(
        "conveyor run: loading %s (the first run on a machine converts the model and builds the CPU kernels, one-time "
        "steps of minutes; later runs find both cached)", args.model,
    )
    try:
        llm = LLM(model=args.model, dtype=args.dtype, device=args.device, **engine_options)
    except (ValueError, OSError) as failure:
        return _fail(f"cannot start the engine with model {args.model!r}: {failure}")
    try:
        for name, folder in adapters.items():
            llm.add_lora(name, folder)
    except ValueError as failure:
        llm.engine.close()
        return _fail(f"cannot serve the LoRA adapter: {failure}")

    try:
        summary = run_batch_file(
            input_path,
            output_path,
            llm,
            progress=request_progress(mode),
            models=ModelNames(
                process_models(
                    [llm.model_name], args.embedding_model, list(adapters), accepts_images=llm.engine.accepts_images
                ),
                aliases,
            ),
            make_embedder=lambda: Embedder(args.embedding_model, dtype=args.dtype, device=args.device),
        )
    finally:
        llm.engine.close()

    if args.quiet:
        return 0
    failures = ", ".join(f"{count} {code}" for code, count in sorted(summary.failures_by_code.items()))
    print(
        f"conveyor run: {summary.total} requests, {summary.succeeded} succeeded, {summary.failed} failed"
        + (f" ({failures}; see their error records)" if failures else "")
        + f"; results in {output_path}",
        file=sys.stderr,
    )
    return 0


def _add_up_command(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = subcommands.add_parser(
        "up",
        help="run the whole batch service on this machine (API, worker, beat; embedded PostgreSQL, Redis, S3)",
        description="Start the API, one worker and beat in the foreground. PostgreSQL, Redis and S3 run embedded, "
        "with their data under --data-dir, unless CONVEYOR_DATABASE_URL, CONVEYOR_REDIS_URL or "
        "CONVEYOR_S3_ENDPOINT_URL is set. Migrations run on every start; the first start prints an API key. "
        "Ctrl-C (or SIGTERM) stops everything; starting again on the same data directory finds the data again.",
    )
    up.add_argument(
        "--data-dir",
        type=Path,
        help="where the embedded servers keep their data (default: $XDG_DATA_HOME/conveyor, ~/.local/share/conveyor)",
    )
    up.add_argument("--host", help="interface the API listens on (default: CONVEYOR_API_HOST)")
    up.add_argument("--port", type=int, help="port the API listens on (default: CONVEYOR_API_PORT)")
    up.set_defaults(handler=_up)


def _up(args: argparse.Namespace) -> int:
    from conveyor.up import UpOptions, default_data_dir, run_up

    return run_up(UpOptions(data_dir=args.data_dir or default_data_dir(), api_host=args.host, api_port=args.port))


def _add_bench_command(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # bench.options, not bench.throughput or bench.report: those import torch and the engine, which only a run needs.
    from bench.options import add_report_arguments, add_throughput_arguments, module_docstring

    bench = subcommands.add_parser(
        "bench",
        help="offline throughput: conveyor vs Hugging Face static-batch generate on the same requests; "
        "`bench report`: the continuous-batching report with plots",
        description=module_docstring("bench.throughput"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_throughput_arguments(bench)
    bench.set_defaults(handler=_bench)
    reports = bench.add_subparsers(dest="bench_command", metavar="{report}")
    report_parser = reports.add_parser(
        "report",
        help="static vs continuous batching vs HF, arrival rates, chunk sizes, batch-job scheduling: report.md + plots",
        description=module_docstring("bench.report"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_report_arguments(report_parser)
    report_parser.set_defaults(handler=_bench_report)


def _bench(args: argparse.Namespace) -> int:
    from bench import throughput

    throughput.run(args)
    return 0


def _bench_report(args: argparse.Namespace) -> int:
    from bench import report

    report.run(args)
    return 0


def _add_api_command(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    api = subcommands.add_parser(
        "api",
        help="serve the HTTP API (Files, Batches; OpenAPI docs at /docs)",
        description="Serve the OpenAI-compatible HTTP API with uvicorn. Configuration comes from CONVEYOR_* "
        "environment variables (see the README); --host and --port override CONVEYOR_API_HOST / CONVEYOR_API_PORT.",
    )
    api.add_argument("--host", help="interface to listen on")
    api.add_argument("--port", type=int, help="port to listen on")
    api.add_argument("--workers", type=int, default=1, help="uvicorn worker processes (default: 1)")
    api.set_defaults(handler=_api)


def _api(args: argparse.Namespace) -> int:
    import uvicorn

    from jobs.telemetry.logs import logging_config
    from jobs.settings import Settings

    settings = Settings.from_env()
    uvicorn.run(
        "api.app:create_app",
        factory=True,
        host=args.host or settings.api_host,
        port=args.port or settings.api_port,
        workers=args.workers,
        log_level="info",
        log_config=logging_config(settings.log_format),
        access_log=False,
    )
    return 0


def _add_worker_command(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    worker = subcommands.add_parser(
        "worker",
        help="run a GPU worker: one engine fed by concurrent run_chunk tasks (Celery)",
        description="Load the engine once, then consume from Redis the control queue, the gpu queue (jobs bound to no "
        "model) and the queues of the models it serves (gpu.<model id>). Configuration "
        "comes from CONVEYOR_* environment variables (see the README).",
    )
    worker.add_argument(
        "--queues", default=None, help="comma-separated queues (default: control, gpu and its models' gpu.<model id>)"
    )
    worker.add_argument("--loglevel", default="INFO")
    worker.add_argument(
        "--devices",
        help="run one engine per group of --tensor-parallel-size devices, each its own worker process: CUDA indices "
        "(0,1,2,3) or cpu entries (cpu,cpu); default CONVEYOR_WORKER_DEVICES, else one engine",
    )
    worker.add_argument(
        "--tensor-parallel-size", type=int, metavar="N",
        help="devices each engine is sharded over (default CONVEYOR_ENGINE_TENSOR_PARALLEL_SIZE, else 1)",
    )
    worker.add_argument("--node-name", help="Celery node name of this worker (default: celery@hostname)")
    worker.set_defaults(handler=_worker)


def _worker(args: argparse.Namespace) -> int:
    from conveyor.worker_groups import device_groups, group_environment, run_worker_groups, worker_command
    from jobs.telemetry.logs import configure_logging
    from jobs.settings import Settings, replace
    from jobs.worker import run_worker

    settings = Settings.from_env()
    configure_logging(settings, args.loglevel)
    size = args.tensor_parallel_size or settings.engine_config.tensor_parallel_size
    devices = args.devices if args.devices is not None else settings.worker_devices
    if devices:
        try:
            groups = device_groups(devices, size)
        except ValueError as failure:
            return _fail(str(failure))
        return run_worker_groups(
            [worker_command(args.queues, args.loglevel, index) for index in range(len(groups))],
            [
                group_environment(group, index, size, settings.worker_metrics_port, os.environ)
                for index, group in enumerate(groups)
            ],
        )
    settings = replace(settings, engine_options={**settings.engine_options, "tensor_parallel_size": size})
    return run_worker(
        settings, queues=args.queues.split(",") if args.queues else None, loglevel=args.loglevel, node_name=args.node_name
    )


def _add_beat_command(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    beat = subcommands.add_parser(
        "beat",
        help="run Celery beat: sends the periodic sweeps (due schedules, expired batches, webhook retries)",
        description="Send the periodic sweep tasks every CONVEYOR_BEAT_INTERVAL_SECONDS. Running two beats is "
        "safe: every sweep claims its work in the database.",
    )
    beat.add_argument("--loglevel", default="INFO")
    beat.set_defaults(handler=_beat)


def _beat(args: argparse.Namespace) -> int:
    from jobs.celery_app import celery_app
    from jobs.telemetry.logs import configure_logging
    from jobs.settings import Settings

    configure_logging(Settings.from_env(), args.loglevel)
    celery_app.Beat(loglevel=args.loglevel, quiet=True).run()
    return 0


def _add_db_command(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    db = subcommands.add_parser("db", help="database migrations (Alembic)")
    actions = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    upgrade = actions.add_parser("upgrade", help="apply migrations up to REVISION (default: head)")
    upgrade.add_argument("revision", nargs="?", default="head")
    upgrade.set_defaults(handler=_db_migrate)
    downgrade = actions.add_parser("downgrade", help="revert migrations down to REVISION (e.g. base)")
    downgrade.add_argument("revision")
    downgrade.set_defaults(handler=_db_migrate)


def _db_migrate(args: argparse.Namespace) -> int:
    from jobs import db
    from jobs.settings import Settings

    migrate = db.upgrade if args.db_command == "upgrade" else db.downgrade
    migrate(Settings.from_env().database_url, args.revision)
    return 0


def _add_keys_command(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = subcommands.add_parser("keys", help="API keys")
    actions = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    create = actions.add_parser(
        "create", help="print a new API key for a project (created on first use); only its hash is stored"
    )
    create.add_argument("--project", required=True, help="project (tenant) name")
    create.set_defaults(handler=_keys_create)
    revoke = actions.add_parser(
        "revoke", help="revoke an API key by its id (`key_...`, printed by create); refused at once by every API process"
    )
    revoke.add_argument("key_id")
    revoke.set_defaults(handler=_keys_revoke)


def _keys_create(args: argparse.Namespace) -> int:
    from jobs.keys import create_key_in_database
    from jobs.settings import Settings

    created = create_key_in_database(Settings.from_env().database_url, args.project)
    print(f"project {created.project_name} ({created.project_id}), key {created.key_id}:", file=sys.stderr)
    print(created.secret)
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    from jobs import db
    from jobs.keys import revoke_key
    from jobs.settings import Settings

    engine = db.make_engine(Settings.from_env().database_url, pool_size=1)
    try:
        with db.make_session_factory(engine).begin() as session:
            revoked = revoke_key(session, args.key_id)
    finally:
        engine.dispose()
    if not revoked:
        return _fail(f"no live API key {args.key_id}")
    print(f"revoked {args.key_id}", file=sys.stderr)
    return 0


def _fail(message: str) -> int:
    print(f"conveyor: error: {message}", file=sys.stderr)
    return 1
